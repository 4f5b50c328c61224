#!/usr/bin/env bash
# restart.sh ROLE COMMAND [ARGS...]: run one ddiloco process and bring it back when it dies, the way
# `ddiloco run` supervises its children (docs/clusters.md). ROLE is `syncer` or `learner`.
#
# - exit 0: a learner is done (not restarted), unless its status.json says `stopped`: a SIGTERM this script
#   did not pass on (a preemption, a `kill` of the learner alone) stopped it before its budget, and it is
#   restarted (its run directory and id from --run-dir and --learner-id, or DDILOCO_RUN_DIR and
#   DDILOCO_LEARNER_ID for a script of your own); a syncer exits 0 only when stopped, so it is restarted
#   unless this script was told to stop;
# - exit 2 (bad flags or config) or 3 (refused by the syncer): a restart would fail the same way, so
#   this script exits with that code;
# - anything else (a crash, kill -9, exit 4 = the syncer never answered): restarted after a backoff of
#   1 s doubling to 8 s, back to 1 s after a run of STABLE_AFTER_S seconds.
# SIGTERM or SIGINT (scancel, the job's time limit, the batch script stopping the syncer) is passed on to
# the process, which saves its state and exits; then this script exits with its code.
set -u

if [ "$#" -lt 2 ] || { [ "$1" != syncer ] && [ "$1" != learner ]; }; then
    echo "usage: restart.sh syncer|learner COMMAND [ARGS...]" >&2
    exit 2
fi
role=$1
shift

STABLE_AFTER_S=${STABLE_AFTER_S:-30}
MAX_DELAY_S=8
stopping=0
child=0
on_stop() {
    stopping=1
    if [ "$child" -gt 0 ]; then
        kill -TERM "$child" 2>/dev/null
    fi
}
trap on_stop TERM INT

# The learner's status.json, from its command's --run-dir and --learner-id or its DDILOCO_* environment.
learner_status() {
    local dir=${DDILOCO_RUN_DIR:-} id=${DDILOCO_LEARNER_ID:-} previous="" arg
    for arg in "$@"; do
        case "$previous" in
            --run-dir) dir=$arg ;;
            --learner-id) id=$arg ;;
        esac
        case "$arg" in
            --run-dir=*) dir=${arg#--run-dir=} ;;
            --learner-id=*) id=${arg#--learner-id=} ;;
        esac
        previous=$arg
    done
    if [ -n "$dir" ] && [ -n "$id" ]; then
        echo "$dir/learners/$id/status.json"
    fi
}

stopped_before_budget() {
    local status
    status=$(learner_status "$@")
    [ -n "$status" ] && grep -Eq '"state": *"stopped"' "$status" 2>/dev/null
}

delay=1
while :; do
    started=$(date +%s)
    "$@" &
    child=$!
    # `wait` returns early when a trapped signal arrives: wait again until the process has really exited.
    code=0
    wait "$child" || code=$?
    while kill -0 "$child" 2>/dev/null; do
        code=0
        wait "$child" || code=$?
    done
    child=0
    if [ "$stopping" -eq 1 ]; then
        exit "$code"
    fi
    case "$code" in
        0) if [ "$role" = learner ]; then
               if ! stopped_before_budget "$@"; then exit 0; fi
               echo "restart.sh: learner stopped before its budget by a signal this script did not pass on" >&2
           fi ;;
        2 | 3) echo "restart.sh: $role exited with $code: not restarting" >&2; exit "$code" ;;
    esac
    if [ $(($(date +%s) - started)) -ge "$STABLE_AFTER_S" ]; then
        delay=1
    fi
    echo "restart.sh: $role exited with $code on $(hostname): restarting in ${delay} s" >&2
    sleep "$delay"
    if [ "$delay" -lt "$MAX_DELAY_S" ]; then
        delay=$((delay * 2))
    fi
done
