#!/bin/bash
# One worker of the restart-from-checkpoint baseline (restart.sh), as torchrun starts it
# and starts it again after a failure (--max-restarts): it resumes from the job's last
# checkpoint when there is one, else starts from the beginning.
#   restart_worker.sh CHECKPOINT_DIR TRAINER_FLAGS...
dir=$1; shift
resume=()
[ -f "$dir/checkpoint.pt" ] && resume=(--resume "$dir/checkpoint.pt")
echo "restart_worker: rank ${RANK:-?} (restart ${TORCHELASTIC_RESTART_COUNT:-0})" \
     "${resume[*]:-from the beginning}" >&2
exec python -m trainer --checkpoint-dir "$dir" "${resume[@]}" "$@"
