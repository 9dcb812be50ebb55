"""Per-rank checks: torch's peers (trainer/torch_peers.py) beside our strategies.

Run on spawned gloo ranks by test_compare.py. Where the math is the same, ours and
torch's must end with the same parameters, and be measured alike (trainer/timing.py,
trainer/bench.py).
"""
import argparse
import importlib.util
import os
import threading
import time

import torch
import torch.nn.functional as F

import collectives
from checks_sync import mean_over_ranks, mlp, shard, train_mlp
from collectives import sync
from trainer import bench, torch_peers
from trainer.timing import SentBytes


def train_with_peer(peer, module, make_optimizer, loss_at, steps):
    """Train `module` wrapped by torch peer `peer`, in the trainer's order of moments:
    loss_at(model, step) is the step's loss. Returns the losses."""
    model = peer.wrap(module)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = loss_at(model, step)
        loss.backward()
        losses.append(loss.item())
        peer.after_backward(module)
        optimizer.step()
        peer.after_step(module, step)
    peer.close()
    return losses


def train_peer(comm, name, steps=5, lr=0.1, fixed_batch=False, batchnorm=False, **options):
    """Train the checks' MLP with a torch peer; return the state and the losses."""
    module = mlp(batchnorm)

    def loss_at(model, step):
        x, y = shard(comm, 0 if fixed_batch else step)
        return F.cross_entropy(model(x), y)
    losses = train_with_peer(torch_peers.create(name, **options), module,
                             lambda params: torch.optim.SGD(params, lr=lr), loss_at, steps)
    return {k: v.clone() for k, v in module.state_dict().items()}, losses


PERIODIC = {"ddp-localsgd": {"period": 2}, "ddp-hier-localsgd": {"period": 2},
            "torchft-diloco": {"period": 2}}


def every_peer_learns(comm):
    """Each peer, 10 steps on one batch per rank: the loss averaged over the ranks falls.
    Returns {name: (first, last)}."""
    os.environ["LOCAL_WORLD_SIZE"] = str(comm.world_size)  # one host (ddp-hier-localsgd)
    losses = {}
    for name in torch_peers.NAMES:
        if name == "torchft-diloco" and importlib.util.find_spec("torchft") is None:
            continue  # an optional extra
        options = PERIODIC.get(name, {})
        _, trace = train_peer(comm, name, steps=10, fixed_batch=True, **options)
        ends = torch.tensor([trace[0], trace[-1]], dtype=torch.float64)
        torch.distributed.all_reduce(ends)
        losses[name] = tuple((ends / comm.world_size).tolist())
    return losses


def powersgd_peer_on_a_model_of_two_buckets(comm, steps=5):
    """torch's PowerSGD peer on gpt-tiny, whose gradients torch's DDP puts in two buckets
    (its first is capped at 1 MiB), AdamW, 5 steps (compressed from the third): on 4
    ranks torch's hook alone has the ranks' collectives out of order (trainer/
    torch_peers.py, one_bucket_at_a_time). Returns the losses and whether every rank
    ends with the same parameters."""
    from trainer.tasks.gpt import build_gpt
    torch.manual_seed(0)
    module = build_gpt("gpt-tiny")
    generator = torch.Generator().manual_seed(comm.rank)
    tokens = torch.randint(0, 256, (4, 32), generator=generator)  # each rank's, every step

    def loss_at(model, step):
        return F.cross_entropy(model(tokens)[:, :-1].reshape(-1, 256),
                               tokens[:, 1:].reshape(-1))
    losses = train_with_peer(torch_peers.create("ddp-powersgd"), module,
                             lambda params: torch.optim.AdamW(params, lr=3e-3), loss_at, steps)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(comm.world_size)]
    torch.distributed.all_gather(gathered, flat)
    return losses, all(torch.equal(flat, other) for other in gathered)


def keep_floating_buffers_of_step(last, kept):
    """An after_optimizer for train_mlp: at step `last`, copy the floating-point buffers
    into `kept`, as they are before the strategy's after_step averages them."""
    def keep(module, step):
        if step == last:
            kept.update({name: buffer.clone() for name, buffer in module.named_buffers()
                         if buffer.is_floating_point()})
    return keep


def ours_equal_torch_where_the_math_is_the_same(comm):
    """allreduce == ddp, local-sgd == ddp-localsgd after whole periods (plain SGD, float64);
    fp16 == ddp-fp16 to fp16 rounding; on the MLP with BatchNorm. Returns the largest
    differences.

    allreduce and fp16 take rank 0's BatchNorm buffers before each forward, as torch's
    DDP does: their parameters and buffers are compared. Local SGD differs from torch's
    post-local SGD by design in the buffers (ours averages them with the parameters,
    torch's leaves them to DDP's broadcast): its parameters are compared with torch's,
    and its buffers with the mean over the ranks of what they held before its last
    averaging."""
    differences = {}
    pairs = [("allreduce", "ddp", {}, {}),
             ("local-sgd", "ddp-localsgd", {"period": 3}, {"period": 3}),
             ("local-sgd", "ddp-localsgd", {"period": 2, "warmup_steps": 2},
              {"period": 2, "warmup_steps": 2}),
             ("fp16", "ddp-fp16", {}, {})]
    parameters = {name for name, _ in mlp(batchnorm=True).named_parameters()}
    for ours_name, peer_name, ours_options, peer_options in pairs:
        steps = 6  # whole periods for every pair above
        before_averaging = {}
        ours = train_mlp(comm, ours_name, steps=steps, batchnorm=True,
                         after_optimizer=keep_floating_buffers_of_step(steps, before_averaging),
                         **ours_options)
        theirs, _ = train_peer(comm, peer_name, steps=steps, batchnorm=True, **peer_options)
        compared = parameters if ours_name == "local-sgd" else set(ours)
        largest = max((ours[k] - theirs[k]).abs().max().item() for k in compared)
        key = f"{ours_name}{ours_options} vs {peer_name}"
        differences[key] = largest
        if ours_name == "local-sgd":
            differences[f"{key}: our buffers vs the mean of the ranks' before averaging"] = max(
                (ours[k] - mean_over_ranks(buffer)).abs().max().item()
                for k, buffer in before_averaging.items())
    # Local SGD without averaging at the end would leave the ranks apart: check they agree
    # (in their parameters: torch's buffers are each rank's, updated from its own batch).
    replicas = train_peer(comm, "ddp-localsgd", steps=6, period=3, batchnorm=True)[0]
    digest = torch.cat([replicas[name].flatten() for name in sorted(parameters)])
    gathered = [torch.empty_like(digest) for _ in range(comm.world_size)]
    torch.distributed.all_gather(gathered, digest)
    differences["ddp-localsgd replicas after a period"] = max(
        (g - digest).abs().max().item() for g in gathered)
    return differences


def as_two_hosts(comm):
    """Make 4 ranks of this machine two hosts of two ranks, by the name each rank's host
    gives (which our topology and torch's peer both go by)."""
    import socket
    from collectives.transport import topology
    socket.gethostname = lambda: f"host{comm.rank // 2}"
    comm.topology = topology.Topology.exchange(comm)
    assert comm.topology.hosts == [[0, 1], [2, 3]], comm.topology.hosts


def hier_local_sgd_equals_torchs_averager(comm):
    """hier-local-sgd against ddp-hier-localsgd on 2 hosts x 2 ranks (plain SGD, float64,
    parameters compared: buffers differ by design as for local-sgd). Returns the largest
    difference for each setting."""
    as_two_hosts(comm)
    parameters = {name for name, _ in mlp(batchnorm=True).named_parameters()}
    differences = {}
    for options in ({"period": 4, "local_period": 1}, {"period": 4, "local_period": 2},
                    {"period": 2, "local_period": 1, "warmup_steps": 2}):
        ours = train_mlp(comm, "hier-local-sgd", steps=8, batchnorm=True, **options)
        theirs, _ = train_peer(comm, "ddp-hier-localsgd", steps=8, batchnorm=True, **options)
        differences[str(options)] = max((ours[k] - theirs[k]).abs().max().item()
                                        for k in parameters)
    return differences


def hier_peer_refuses_ranks_dealt_round_robin(comm):
    """4 ranks whose hosts alternate (host0, host1, host0, host1): torch's averager cannot
    group them, and says so on every rank; ours averages each host's ranks (0 and 2,
    1 and 3). Returns (the peer's error, whether our host partners agree after a host
    averaging step)."""
    import socket
    from collectives.transport import topology
    socket.gethostname = lambda: f"host{comm.rank % 2}"
    comm.topology = topology.Topology.exchange(comm)
    try:
        train_peer(comm, "ddp-hier-localsgd", steps=1, period=4)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    ours = train_mlp(comm, "hier-local-sgd", steps=3, period=4, local_period=1)
    digest = torch.cat([ours[name].flatten() for name in sorted(ours)])
    gathered = [torch.empty_like(digest) for _ in range(comm.world_size)]
    torch.distributed.all_gather(gathered, digest)
    partner = (comm.rank + 2) % 4
    return error, torch.equal(gathered[partner], digest), torch.equal(gathered[comm.rank ^ 1],
                                                                      digest)


def diloco_equals_torchft(comm, steps=8):
    """diloco against torchft's DiLoCo (plain, and streaming with 2 fragments and a
    delay of 1 step), plain SGD inside, float64: the largest difference in parameters
    for each setting."""
    differences = {}
    for options in ({"period": 4}, {"period": 4, "fragments": 2, "delay": 1},
                    {"period": 4, "fragments": 2, "delay": 1, "alpha": 0.5}):
        ours = train_mlp(comm, "diloco", steps=steps, **options)
        theirs, _ = train_peer(comm, "torchft-diloco", steps=steps, **options)
        differences[str(options)] = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    return differences


def diloco_by_hand(comm, steps, period, warmup_steps=0):
    """DiLoCo written out with torch's own all-reduce: `warmup_steps` steps of averaged
    gradients, then every `period` steps the outer Nesterov SGD on the averaged
    pseudo-gradient, starting from the weights at the warm-up's end. Returns the state."""
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    synced = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(synced, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        x, y = shard(comm, step)
        inner.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step <= warmup_steps:
            for p in model.parameters():
                p.grad = mean_over_ranks(p.grad)
        inner.step()
        with torch.no_grad():
            if step == warmup_steps:
                for start, p in zip(synced, model.parameters()):
                    start.copy_(p)
            if step > warmup_steps and (step - warmup_steps) % period == 0:
                for start, p in zip(synced, model.parameters()):
                    start.grad = mean_over_ranks(start - p)
                outer.step()
                for start, p in zip(synced, model.parameters()):
                    p.copy_(start)
    return model.state_dict()


def streaming_diloco_with_one_fragment_and_no_delay_is_diloco(comm, steps=8):
    """diloco with fragments=1, delay=0 against DiLoCo written out by hand (period 4),
    without and with a warm-up of 3 synchronous steps (syncs after steps 7 and 11).
    Returns the largest difference in parameters of each."""
    differences = []
    for warmup_steps, steps in ((0, steps), (3, 11)):
        ours = train_mlp(comm, "diloco", steps=steps, period=4, fragments=1, delay=0,
                         warmup_steps=warmup_steps)
        by_hand = diloco_by_hand(comm, steps, 4, warmup_steps)
        differences.append(max((ours[k] - v).abs().max().item() for k, v in by_hand.items()))
    return differences


def bytes_sent_per_step(comm, names=("allreduce", "ddp-collectives"), steps=3):
    """Each sync trains the checks' MLP (one bucket); returns ({name: bytes this rank
    sent per step, as the trainer counts them}, the model's bytes). One step of warm-up
    first: torch's DDP rebuilds its buckets after its first."""
    sent_per_step = {}
    for name in names:
        module = mlp()
        if torch_peers.is_peer(name):
            strategy = torch_peers.create(name)
            model = strategy.wrap(module)
        else:
            strategy = sync.create(name)
            model = collectives.DistributedDataParallel(module, sync=strategy,
                                                        moments="loop", comm=comm)
        sent = SentBytes(comm, strategy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps + 1):
            if step == 1:
                before = sent.read()
            x, y = shard(comm, step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            strategy.after_backward(module)
            optimizer.step()
            strategy.after_step(module, step + 1)
        sent_per_step[name] = (sent.read() - before) / steps
        strategy.close()
    return sent_per_step, sum(p.numel() * p.element_size() for p in mlp().parameters())


class SlowWorker:
    """Makes a strategy's communication thread slow (each job sleeps first, as on a slow
    network) and counts the jobs it has been given and not yet finished."""

    def __init__(self, worker, seconds: float):
        self.unfinished, self.lock = 0, threading.Lock()
        submit = worker.submit

        def slow_submit(job, name="communication", **trace_args):
            with self.lock:
                self.unfinished += 1

            def slow_job():
                try:
                    time.sleep(seconds)
                    job()
                finally:
                    with self.lock:
                        self.unfinished -= 1
            return submit(slow_job, name, **trace_args)
        worker.submit = slow_submit


def background_when_the_window_closes(comm, name):
    """trainer.bench's variant `name` (one that communicates in the background), warmed
    up and timed for one round on a slow communication thread. Returns (jobs unfinished
    as its compute-only sample starts, the bytes its window counted, the bytes sent from
    before its first timed step to that sample's start, the bytes sent from that
    sample's end until all had settled)."""
    args = argparse.Namespace(trace=None, trace_steps=0, model="resnet18", bucket_mb=25.0,
                              algorithm="auto", batch_size=2, steps=2, warmup=1)
    variant = bench.Variant(comm, name, args)
    slow = SlowWorker(variant.strategy.worker, seconds=0.3)
    variant.warm_up()
    seen = {}
    compute_only_step = variant.compute_only_step

    def observed_compute_only_step():
        seen.update(unfinished=slow.unfinished, started=variant.sent.read())
        compute_only_step()  # (its forward broadcasts BatchNorm's buffers: not counted)
        seen.update(ended=variant.sent.read())
    variant.compute_only_step = observed_compute_only_step
    before = variant.sent.read()
    variant.round(comm)
    time.sleep(1.0)  # whatever was still in flight has finished by now
    after = variant.sent.read() - seen["ended"]
    variant.strategy.close()
    return seen["unfinished"], variant.sent_bytes, seen["started"] - before, after
