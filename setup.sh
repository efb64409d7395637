#!/usr/bin/env bash
# Fresh machine -> .venv with the pinned dependencies, then a sanity check of what was installed; a key in
# credentials/ that other users may read is made private (chmod 600).
#   torch (CUDA build where `nvidia-smi` finds a GPU, CPU build otherwise), requirements.txt,
#   requirements-dev.txt (unless --no-dev). A second run with nothing changed installs nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

TORCH_VERSION="$(sed -n 's/^torch==\([^ #]*\).*/\1/p' requirements.txt 2>/dev/null || true)"  # its one pin
VENV=".venv"
STAMP="$VENV/.setup-stamp"                # hash of what was installed; equal hash -> skip pip
COMPILE_RESULT="$VENV/.setup-compile-check"
PYTHON="${PYTHON:-python3}"
COMPILE_TIMEOUT="${SETUP_COMPILE_TIMEOUT:-240}"

usage() {
    cat <<EOF
Usage: ./setup.sh [--no-dev] [--force] [--check]

Creates $VENV (python3 -m venv) and installs torch==$TORCH_VERSION, requirements.txt and, unless --no-dev,
requirements-dev.txt. Then imports everything and reports torch, CUDA, bf16 and torch.compile.

  --no-dev    skip the test dependencies (pytest, the GCS emulator; pyarrow and Ray, optional for prepare_data.py)
  --force     reinstall the requirements even when $STAMP says they are current
  --check     re-run the torch.compile check even when nothing is installed
  -h, --help  this text

Environment:
  PYTHON                 interpreter that creates the venv (default python3; needs 3.10+)
  TORCH_INDEX_URL        pip index for torch, e.g. PyTorch's CPU wheel index on a CPU-only Linux box
                         (the plain PyPI wheel for Linux is the CUDA build)
  SETUP_COMPILE_TIMEOUT  seconds allowed for the torch.compile check (default $COMPILE_TIMEOUT)
EOF
}

step() { echo "==> $*"; }
die() { echo "setup.sh: error: $*" >&2; exit 1; }

dev=1 force=0 recheck=0
for arg in "$@"; do
    case "$arg" in
        --no-dev) dev=0 ;;
        --force) force=1 ;;
        --check) recheck=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup.sh: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done

# --- credentials -------------------------------------------------------------------------------------
# A service-account key other users may read is theirs too: only its owner keeps read access.
for key in credentials/*.json; do
    [[ -f "$key" ]] || continue
    perms="$(ls -l "$key")"
    if [[ "${perms:4:1}" == "r" || "${perms:7:1}" == "r" ]]; then
        chmod 600 "$key"
        step "$key was readable by other users: chmod 600 (now only its owner can read it)"
    fi
done

# --- Python ------------------------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "'$PYTHON' not found; install Python 3.10 or newer (or set PYTHON=/path/to/python3.X)"
py_version="$("$PYTHON" -c 'import platform; print(platform.python_version())')"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "Python $py_version is too old: this project needs 3.10 or newer (set PYTHON=python3.11 to use another)"

# --- GPU ---------------------------------------------------------------------------------------------
gpu_count=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpu_count="$(nvidia-smi -L 2>/dev/null | grep -cE '^GPU [0-9]+:' || true)"
fi
if [[ "$gpu_count" -gt 0 ]]; then torch_build="cuda"; else torch_build="cpu"; fi
step "Python $py_version; $gpu_count NVIDIA GPU(s) found -> torch $TORCH_VERSION ($torch_build build)"

# --- virtual environment -----------------------------------------------------------------------------
VPY="$VENV/bin/python"
if [[ -d "$VENV" ]] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    step "$VENV exists but its python does not run; recreating it"
    rm -rf "$VENV"
fi
if [[ ! -d "$VENV" ]]; then
    step "creating $VENV"
    "$PYTHON" -m venv "$VENV" \
        || die "'$PYTHON -m venv' failed (on Debian/Ubuntu: apt install python3-venv), or remove a partial $VENV"
fi
"$VPY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$VENV was made with a Python older than 3.10; remove it (rm -rf $VENV) and run ./setup.sh again"

# --- dependencies ------------------------------------------------------------------------------------
[[ -n "$TORCH_VERSION" ]] || die "requirements.txt has no torch==VERSION line (run setup.sh from a whole checkout)"
requirement_files=(requirements.txt)
[[ "$dev" -eq 1 ]] && requirement_files+=(requirements-dev.txt)
stamp_key="$("$VPY" - "$TORCH_VERSION" "$torch_build" "$dev" "${TORCH_INDEX_URL:-}" pyproject.toml "${requirement_files[@]}" <<'EOF'
import hashlib, sys
torch_version, build, dev, index, *files = sys.argv[1:]
h = hashlib.sha256(f"torch=={torch_version} build={build} dev={dev} index={index} python={sys.version}".encode())
for name in files:
    h.update(name.encode() + b"\0" + open(name, "rb").read())
print(h.hexdigest())
EOF
)"

# --no-compile: pip byte-compiles what it installs one file at a time; byte_compile does it once pip is done, on every
# core (a fresh setup on 2 cores: 163 s -> 128 s). Every module byte-compiled, so no process compiles one at each
# start where Python may not write its caches (PYTHONDONTWRITEBYTECODE=1, a read-only image). A file that does not
# compile is left as pip leaves it: an error at its import, if ever imported.
pip_install() {
    "$VPY" -m pip install --disable-pip-version-check --no-compile "$@"
}
byte_compile() {
    "$VPY" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
}
site_dir="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

install_torch() {
    local installed base
    installed="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
    base="${installed%%+*}"
    if [[ "$base" == "$TORCH_VERSION" && ! ( "$torch_build" == "cuda" && "$installed" == *+cpu ) ]]; then
        step "torch $installed already installed"
        return
    fi
    if [[ -n "$installed" ]]; then
        step "replacing torch $installed"
        "$VPY" -m pip uninstall -y -q torch || die "pip uninstall torch failed"
    fi
    local args=("torch==$TORCH_VERSION")
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        args+=(--index-url "$TORCH_INDEX_URL")
        step "installing torch==$TORCH_VERSION from TORCH_INDEX_URL=$TORCH_INDEX_URL"
    else
        step "installing torch==$TORCH_VERSION from pip's configured index"
        if [[ "$torch_build" == "cpu" && "$(uname -s)" == "Linux" ]]; then
            echo "    (no GPU: to skip the CUDA libraries of the default Linux wheel, set TORCH_INDEX_URL to a CPU wheel index)"
        fi
    fi
    pip_install "${args[@]}" || die "pip install torch==$TORCH_VERSION failed (see the pip output above)"
}

installed_now=0
if [[ "$force" -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$stamp_key" ]]; then
    step "dependencies up to date ($STAMP matches); nothing to install"
else
    rm -f "$STAMP" "$COMPILE_RESULT"
    install_torch
    for file in "${requirement_files[@]}"; do
        step "installing $file"
        pip_install -r "$file" || die "pip install -r $file failed (see the pip output above)"
    done
    step "byte-compiling the installed packages"
    byte_compile "$site_dir"
    installed_now=1
fi

# The project itself, editable: `utils`, `configs` and the entry points import from this checkout wherever
# they run (pyproject.toml; its dependencies are the requirement files above, already installed).
if [[ "$installed_now" -eq 1 ]] || ! "$VPY" -m pip list --editable 2>/dev/null | grep -q "^neox-pretrain .* $PWD\$"; then
    step "installing this project (editable)"
    pip_install --no-deps --no-build-isolation -q -e . || die "pip install -e . failed (see the pip output above)"
fi

# Every Python in the venv leaves out torchao's harmless import warnings on machines without its CUDA
# kernels (utils/quiet_imports.py says which); a copy of the module and a .pth line that imports it.
if ! cmp -s utils/quiet_imports.py "$site_dir/neox_quiet_imports.py"; then
    cp utils/quiet_imports.py "$site_dir/neox_quiet_imports.py"
    echo "import neox_quiet_imports" > "$site_dir/neox_quiet_imports.pth"
fi

# this checkout's own modules too (byte_compile above; a second run compiles only what changed)
byte_compile configs utils scripts

# The Slurm tests (tests/e2e/test_slurm.py) start a real one-node cluster: as root with apt-get (a CI machine, a
# container), the dev set installs Debian's Slurm and munge once; elsewhere those tests skip, saying why.
if [[ "$dev" -eq 1 && "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
    step "installing Slurm and munge for the Slurm tests (apt-get)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurmctld slurmd slurm-client munge >/dev/null; }; then
        echo "warning: apt-get could not install slurmctld slurmd slurm-client munge; the Slurm tests will skip" >&2
    fi
fi

# --- sanity check ------------------------------------------------------------------------------------
step "checking the environment"
"$VPY" - "$dev" "$torch_build" "$TORCH_VERSION" <<'EOF' || die "the installed packages do not import (see above); run ./setup.sh --force"
import importlib, importlib.metadata as md, sys

dev, want_build, torch_pin = sys.argv[1] == "1", sys.argv[2], sys.argv[3]
modules = ["torch", "accelerate", "transformers", "tokenizers", "numpy", "safetensors", "tqdm",
           "tensorboard", "google.cloud.storage", "google_crc32c", "pynvml"]
if dev:
    modules += ["pytest", "gcp_storage_emulator", "pyarrow", "ray"]
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:  # report every broken import, not only the first
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
if failed:
    print("  imports that fail:\n    " + "\n    ".join(failed))
    sys.exit(1)

import torch

if torch.__version__.split("+")[0] != torch_pin:
    print(f"  torch {torch.__version__} is installed but {torch_pin} is pinned")
    sys.exit(1)
row = lambda key, value: print(f"  {key:<21} {value}")
row("python", f"{sys.version.split()[0]} ({sys.executable})")
row("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
if torch.cuda.is_available():
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    row("CUDA", f"available, {len(names)} device(s): {', '.join(names)}")
    row("bf16", "supported" if torch.cuda.is_bf16_supported() else "not supported on this GPU: use --mixed-precision fp16")
else:
    row("CUDA", "not available: ./start_training.sh runs on the CPU")
    row("bf16", "CPU only (the demo preset trains in fp32)")
    if want_build == "cuda":
        print("  WARNING: a GPU was found but this torch cannot use it; set TORCH_INDEX_URL to a CUDA wheel "
              "index and run ./setup.sh --force")
for dist in ("accelerate", "transformers", "tokenizers", "numpy", "google-cloud-storage"):
    row(dist, md.version(dist))
if dev:
    row("pytest", md.version("pytest"))
EOF

# torch.compile needs a C compiler on the CPU; unavailable is reported, not fatal (compile_model=false works).
if [[ "$installed_now" -eq 1 || "$recheck" -eq 1 || ! -f "$COMPILE_RESULT" ]]; then
    "$VPY" - "$COMPILE_TIMEOUT" >"$COMPILE_RESULT.tmp" <<'EOF'
import subprocess, sys, time

PROBE = """
import torch
def f(x):
    return torch.sin(x) * 2 + x
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    x = torch.randn(64, device=device)
    assert torch.allclose(torch.compile(f)(x), f(x), atol=1e-5), device
print(" and ".join(devices))
"""
timeout = float(sys.argv[1])
started = time.perf_counter()
try:
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
except subprocess.TimeoutExpired:
    print(f"unavailable (no result within {timeout:.0f}s; SETUP_COMPILE_TIMEOUT raises the limit)")
    sys.exit()
seconds = time.perf_counter() - started
if res.returncode == 0:
    print(f"OK on {res.stdout.strip()} ({seconds:.0f}s)")
else:
    lines = [line for line in (res.stderr or res.stdout).strip().splitlines() if line.strip()]
    print(f"unavailable ({lines[-1][:160] if lines else f'exit {res.returncode}'}); set compile_model=false")
EOF
    mv "$COMPILE_RESULT.tmp" "$COMPILE_RESULT"
    echo "  torch.compile         $(cat "$COMPILE_RESULT")"
else
    echo "  torch.compile         $(cat "$COMPILE_RESULT") [checked earlier; --check re-runs it]"
fi

[[ -f "$STAMP" && "$(cat "$STAMP")" == "$stamp_key" ]] || echo "$stamp_key" >"$STAMP"
step "ready: source $VENV/bin/activate, or run ./start_training.sh --config demo"
