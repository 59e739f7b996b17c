#!/usr/bin/env bash
# Launch the Fashion-MNIST training job under msrun: what the container image and Kubernetes call.
#
# Usage: ./run.sh [main.py flags...]      e.g.  ./run.sh --epochs 3 --data-dir /data
#
# Environment (all optional; every main.py setting also has one, see `python main.py --help`):
#   WORKERS          workers on this node; default: the visible Ascend devices, else 2 CPU workers
#   NODES            nodes in the job (default 1)
#   NODE_RANK        this node's index; default JOB_COMPLETION_INDEX (Indexed Job, Trainer), VC_TASK_INDEX, 0
#   MASTER_ADDR      node 0's address, where msrun's scheduler listens (required when NODES > 1)
#   MASTER_PORT      the scheduler's port; default a free port on one node, 8118 across nodes
#   MS_*             what MindCluster's AscendJob injects, for what is unset above (docs/deployment.md)
#   LOG_DIR          msrun's and each worker's log (default $OUTPUT_DIR/logs, .../logs/nodeN across nodes)
#   CLUSTER_TIMEOUT  seconds msrun waits for every node to join (default 600)
#   MS_NODE_TIMEOUT  seconds without a worker's heartbeat before msrun's scheduler ends the job (default 5)
#   GLOG_v           MindSpore's C++ log level (default 3: errors only)
#   DRY_RUN          1: print the msrun command and exit;  ASCEND_ENV: CANN's environment script, if present
#
# Exit status: 0, or the failing worker's own, else msrun's (docs/operations.md); 143 or 130 after SIGTERM
# or SIGINT.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "run.sh: $*" >&2; exit 2; }

command -v msrun >/dev/null || die "msrun not found: activate the environment with MindSpore installed"
command -v python >/dev/null || die "python not found on PATH: msrun launches 'python'; activate the venv"

: "${ASCEND_ENV:=/usr/local/Ascend/ascend-toolkit/set_env.sh}"
# shellcheck source=/dev/null  # CANN's script, which reads variables that may be unset
[[ ! -f "$ASCEND_ENV" ]] || { set +u; source "$ASCEND_ENV"; set -u; }
# A killed or frozen worker misses its heartbeat (one a second, main.py); msrun's scheduler then ends the job.
# Its default of 30 s held a failed job for 40 s (docs/operations.md).
export GLOG_v=${GLOG_v:-3} MS_NODE_TIMEOUT=${MS_NODE_TIMEOUT:-5}

# MindCluster's ascend-operator (AscendJob) gives the container named ascend MindSpore's own variables. Its
# Scheduler pod is node 0 and trains when it holds NPUs (NPU_POD); without, it runs msrun's scheduler alone.
if [[ -n "${MS_SCHED_HOST:-}" && -n "${MS_LOCAL_WORKER:-}" ]]; then
  : "${WORKERS:=$MS_LOCAL_WORKER}" "${NODES:=$((MS_WORKER_NUM / MS_LOCAL_WORKER))}"
  : "${NODE_RANK:=$MS_NODE_RANK}"
  : "${MASTER_ADDR:=$MS_SCHED_HOST}" "${MASTER_PORT:=$MS_SCHED_PORT}"
  [[ "${MS_ROLE:-}" != MS_SCHED || "${NPU_POD:-}" == true ]] || local_workers=0
fi
: "${NODES:=1}" "${NODE_RANK:=${JOB_COMPLETION_INDEX:-${VC_TASK_INDEX:-0}}}" "${CLUSTER_TIMEOUT:=600}"
# One worker per visible Ascend device (the device plugin's or the runtime's), else 2.
if [[ -z "${WORKERS:-}" ]]; then
  visible=${ASCEND_RT_VISIBLE_DEVICES:-${ASCEND_VISIBLE_DEVICES:-}}
  WORKERS=$(if [[ -n "$visible" ]]; then tr ',' '\n' <<<"$visible"
            else find /dev -maxdepth 1 -name 'davinci[0-9]*'; fi | grep -c .) || WORKERS=2
fi
if [[ -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=8118
  ((NODES > 1)) ||
    MASTER_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
fi
for var in WORKERS NODES NODE_RANK MASTER_PORT CLUSTER_TIMEOUT MS_NODE_TIMEOUT; do
  [[ "${!var}" =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
((WORKERS >= 1 && NODES >= 1)) || die "WORKERS and NODES must be at least 1"
((NODE_RANK < NODES)) || die "NODE_RANK ($NODE_RANK) must be below NODES ($NODES)"
((NODES == 1)) || [[ -n "${MASTER_ADDR:-}" ]] || die "NODES=$NODES needs MASTER_ADDR, the address of node 0"
: "${MASTER_ADDR:=127.0.0.1}"
export LOCAL_WORKERS=$WORKERS NODE_RANK  # main.py shares this node's cores among its workers, names its node

# The job's own checks before msrun: a bad setting ends here, in one line, exit 2; it prints the output dir.
case " $* " in *" -h "* | *" --help "*) exec python "$here/main.py" --help ;; esac
: "${local_workers:=$WORKERS}"
if ((local_workers)); then
  output_dir=$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" \
    python -m fmnist.settings "$((WORKERS * NODES))" "$@")
  LOG_DIR=${LOG_DIR:-$output_dir/logs$( ((NODES == 1)) || echo "/node$NODE_RANK")}  # msrun names logs by rank
fi
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/msrun-scheduler}  # the scheduler alone writes no results
launcher=(msrun "--worker_num=$((WORKERS * NODES))" "--local_worker_num=$local_workers"
  "--master_addr=$MASTER_ADDR" "--master_port=$MASTER_PORT" "--node_rank=$NODE_RANK" "--log_dir=$LOG_DIR"
  "--cluster_time_out=$CLUSTER_TIMEOUT" --join=True python "$here/main.py" "$@")
[[ "${DRY_RUN:-0}" != 1 ]] || { printf '%q ' "${launcher[@]}"; echo; exit 0; }
mkdir -p "$LOG_DIR"
echo "run.sh: node $NODE_RANK of $NODES, $local_workers worker(s), scheduler $MASTER_ADDR:$MASTER_PORT," \
  "logs in $LOG_DIR"

stop() {
  # msrun SIGKILLs its workers on SIGINT and dies on SIGTERM leaving them running: the workers get SIGTERM
  # from here and agree to stop at their next log interval, rank 0 checkpointing that step.
  stop_status=$1
  echo "run.sh: stopping the workers at their next log interval" >&2
  local pid
  for pid in $(tr ' ' '\n' </proc/"$msrun_pid"/task/"$msrun_pid"/children 2>/dev/null); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'MS_ROLE=MS_WORKER'; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
}

describe() {
  case "$1" in
    -9) echo "was killed by SIGKILL (kill -9, or the out-of-memory killer)" ;;
    -*) echo "was killed by signal ${1#-}" ;;
    1) echo "exited with status 1: the replicas' weights differ, or a failure its log names" ;;
    2) echo "exited with status 2: a bad setting or missing data" ;;
    3) echo "exited with status 3: the training diverged" ;;
    4) echo "exited with status 4: a volume it writes to is full" ;;
    *) echo "exited with status $1" ;;
  esac
}

report_failure() {
  # msrun's log names the first failed worker's pid (-9: a signal); the scheduler's log, a frozen rank.
  local pid="" code=$status log="" rank
  read -r pid code < <(grep -m1 -oE 'Worker process [0-9]+ exit with exception\. Error code: -?[0-9]+' \
    "$LOG_DIR/msrun.log" | grep -oE -- '-?[0-9]+' | paste -sd' ') || true
  # No worker named (a node of msrun's scheduler alone): msrun's own status.
  code=${code:-$status}
  rank=$(cat "$LOG_DIR/msrun.log" "$LOG_DIR/scheduler.log" 2>/dev/null |
    grep -m1 -oE 'worker [0-9]+ is the first one timed out' | grep -oE '[0-9]+') || true
  if [[ -n "$rank" && ! "$code" =~ ^(-9|2|3|4)$ ]]; then
    log=$LOG_DIR/worker_$rank.log code=-9
    echo "run.sh: the job failed: rank $rank stopped answering for $MS_NODE_TIMEOUT s (frozen, stopped, or" \
      "its node lost), and msrun ended the job" >&2
  elif [[ -n "$pid" ]]; then
    log=$(grep -l "(pid $pid)" "$LOG_DIR"/worker_*.log 2>/dev/null | head -n1) || true
    echo "run.sh: the job failed: ${log:+${log##*/}, }process $pid $(describe "$code")" >&2
  else
    echo "run.sh: the job failed (msrun exit status $status)" >&2
  fi
  if [[ -f "$log" ]]; then
    echo "run.sh: the last lines of ${log##*/}:" >&2
    grep -vE '^\[(WARNING|INFO)\]' "$log" | tail -n 12 | sed 's/^/    /' >&2
  fi
  echo "run.sh: all logs are in $LOG_DIR" >&2
  if ((code < 0)); then exit $((128 - code)); else exit "$code"; fi
}

stop_status=0 status=0
trap 'stop 143' TERM
trap 'stop 130' INT
# msrun in a session of its own, so that a terminal's Ctrl-C reaches run.sh alone. Its stdout (the workers'
# logs) goes to the console without INFO lines or MindSpore's cluster messages (the logs keep them); its
# stderr (its traceback, which report_failure says better) to a file.
: >"$LOG_DIR/msrun.log"
# shellcheck disable=SC2094  # both append to msrun.log; nothing reads it meanwhile
setsid "${launcher[@]}" 2>>"$LOG_DIR/msrun.log" \
  > >(trap '' INT; grep --line-buffered -Ev '^\[INFO\] |^\[(ERROR|WARNING)\] DISTRIBUTED' |
       tee -ai "$LOG_DIR/msrun.log") &
msrun_pid=$!
until wait "$msrun_pid" && status=0; do  # a trapped signal ends `wait` early, with a status over 128
  status=$?
  kill -0 "$msrun_pid" 2>/dev/null || break
done
# A job that finished all the same (a signal came as it wrote its results) is done.
if ((stop_status && status)); then
  echo "run.sh: stopped; run the same command again to resume from the newest checkpoint" >&2
  exit "$stop_status"
fi
((status == 0)) || report_failure
if ((NODE_RANK == 0 && local_workers)); then
  echo "run.sh: done. Results: $output_dir/summary.json; pictures: $output_dir/*.png; logs: $LOG_DIR"
else
  echo "run.sh: done. Node 0 holds the results; logs of this node: $LOG_DIR"
fi
