#!/usr/bin/env bash
# The clusters we do not have (docs/cost_model.md): ResNet-18 and ResNet-50 steps, traced
# here, replayed on 8 to 1024 ranks (8 per host) at 10, 25 and 100 Gbit/s with the GPU
# cluster's hand-written constants, compute scaled to a GPU's step time. Pure
# computation: seconds, no ranks started.
set -euo pipefail
out=docs/data/model
replay() {  # network trace step-seconds bandwidth
    python -m trainer.replay --trace $2 --constants $out/gpu_cluster.json \
        --ranks 8,64,256,1024 --ranks-per-host 8 --bandwidth $4 --step-time $3 \
        --json $out/use_${1}_$4.jsonl --plot docs/figures/model_${1}_$4.png
}
for bandwidth in 10gbit 25gbit 100gbit; do
    replay resnet18 $out/steps_4x1_1gbit.trace 0.016 $bandwidth
    replay resnet50 $out/resnet50.trace 0.08 $bandwidth
done
