"""Example controllers, each a script for `harmonaize controller run tenant_controllers/examples/<name>.py`."""
