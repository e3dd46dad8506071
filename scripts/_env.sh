# Shared by scripts/up and scripts/test: make .venv and install the project into it, once per pyproject change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.hz-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install --quiet --upgrade pip
  # The CPU build of PyTorch first: a bare 'torch' requirement would pull a multi-GB CUDA build.
  python -m pip install --quiet "torch==2.13.0"
  # setuptools announces every editable install of a multi-package project with a screen of text; it is not a
  # problem of ours, and hiding it keeps real warnings visible.
  PYTHONWARNINGS="ignore:Editable installation:UserWarning" python -m pip install --quiet -e ".[all,test]"
  echo "$want" > "$stamp"
fi
