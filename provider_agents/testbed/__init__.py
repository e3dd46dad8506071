"""The testbed: simulated hosts as Linux network namespaces joined by shaped links (`layout`, `netns`, `links`).

Built for one cloud (its id in every name), removed with it; where namespaces cannot be made, the local cloud stays
on loopback (`netns.unavailable` says why).
"""
