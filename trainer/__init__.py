"""The trainer: `python -m trainer` trains a torchvision ResNet or a byte-level GPT,
data-parallel.

    mpirun -np 4 python -m trainer                  # embedded dataset, no files needed
    mpirun -np 4 python -m trainer --model gpt-tiny # the standard library's text
    python -m trainer --help                         # the manual

The loop (trainer/loop/), what `python -m trainer` runs:
    cli.py          the flags, and the sync strategy they name
    train.py        the training loop, written as its steps: setup, resume, one epoch,
                    evaluate, report and save
    checkpoint.py   atomic checkpoints holding every rank's state (model, optimizer,
                    strategy, random generators), gathered on rank 0

The tasks (trainer/tasks/), what the loop learns, chosen by --model:
    images.py       image classification: ResNets (resnets.py) on the embedded shapes
                    or torchvision's datasets (image_data.py), scored by test accuracy
    language.py     language modelling: a byte-level GPT (gpt.py) on text every
                    machine has (text.py), scored by held-out bits per byte
    optimizers.py   sgd, adamw, muon; warm-up then cosine

The study around it (here), what the loop is measured and compared with:
    bench.py        `python -m trainer.bench`: throughput of each sync strategy beside
                    torch's DDP, timed over the same steps
    replay.py       `python -m trainer.replay`: a bench trace's step replayed on the
                    cost model, for clusters we do not have (docs/cost_model.md)
    compare.py      `python -m trainer.compare`: runs the loop once per strategy, under
                    any launcher or on the emulated cluster, and tabulates the score
                    (test accuracy, held-out bits per byte) against time and bytes
    peer_base.py    what a peer is: another library's code for one of our strategies,
                    driven like ours
    torch_peers.py  torch's own DDP and comm hooks as peers, and the peers by name
    torchft_peer.py torchft's DiLoCo as a peer (the optional torchft extra)
    powersgd_layout.py  torch's PowerSGD state moved along when DDP re-lays its buckets
    timing.py       waited-on-communication and bytes sent, measured alike for ours and
                    torch's

The loop borrows the peers and timing.py: `--sync ddp*` trains with a torch peer, and
its epoch line is measured by timing.py, so that its figures and bench's mean the same
thing.
"""
