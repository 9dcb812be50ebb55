"""Rank functions for tests/test_overlap.py: allreduce with overlap="forward" (buckets
by priority, the optimizer stepped inside the next forward) against plain allreduce."""
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import DistributedDataParallel, sync
from collectives.sync.allreduce import AllReduce

# tiny buckets and chunks, so that a step has several of each (a float64 model of
# about 1600 parameters: buckets of fc, of layer 2, of layer 1; 65-element chunks)
BUCKETS = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001)
CHUNK_MB = 0.0005


class Net(nn.Module):
    """Two conv + BatchNorm layers and a linear one: buffers, biases, several buckets."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2,
                                          nesterov=True),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2),
}


# one bucket of fc's bias, then one of everything else: its head (fc's weight, two
# chunks) is in long before its last gradient when bn2's backward is slowed down
HEAD_FIRST = dict(bucket_cap_mb=1, first_bucket_mb=0.00001)


def train(comm, overlap, algorithm, optimizer, dtype, steps, reduce=None, device="cpu",
          buckets=BUCKETS, slow_bn2=0.0):
    """`steps` steps with a cosine schedule (its learning rate changes every step);
    returns the losses, the parameters as each forward after the first saw them, the
    final parameters, rank 0's buffers, how many parameters the optimizer holds state
    for, and (overlap="forward") the chunks of the last step reduced early.
    slow_bn2: seconds bn2's backward sleeps (gradients after it come that much later)."""
    torch.manual_seed(0)
    model = Net().to(dtype).to(device)
    if slow_bn2:
        model.bn2.register_full_backward_pre_hook(lambda *_: time.sleep(slow_bn2))
    strategy = (reduce or AllReduce)(algorithm=algorithm, overlap=overlap, chunk_mb=CHUNK_MB)
    ddp = DistributedDataParallel(model, sync=strategy, comm=comm, **buckets)
    inner = OPTIMIZERS[optimizer](model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=steps)
    stepper = ddp.step_in_forward(inner) if overlap == "forward" else inner
    generator = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own data
    losses, seen = [], []
    for _ in range(steps):
        x = torch.randn(4, 3, 6, 6, generator=generator, dtype=dtype)
        y = torch.randint(0, 10, (4,), generator=generator)
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(ddp(x), y)  # overlap="forward": the last step is taken here
        seen.append([p.detach().clone() for p in model.parameters()])
        losses.append(loss.item())
        loss.backward()
        stepper.step()
        stepper.zero_grad(set_to_none=True)
        schedule.step()
        # a collective of the loop's own while the buckets may still be on the wire
        collectives.all_reduce(torch.tensor([loss.item()]), op="avg", comm=comm)
    state = stepper.state_dict()  # forward: the last step is taken first
    final = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    early = 0
    if overlap == "forward":
        early = ddp.bucketer.priority.early_chunks
        stepper.close()
    ddp.bucketer.close()
    return losses, seen, final, buffers, len(state["state"]), early


def forward_overlap_equals_allreduce(comm, algorithm, optimizer, dtype_name, steps=6,
                                     device="cpu", **layout):
    """Both schedules, the same data: (bitwise equal?, largest difference, did the
    weights change?) of every loss, every parameter each forward saw, the final
    parameters and buffers. layout: train()'s buckets and slow_bn2."""
    dtype = getattr(torch, dtype_name)
    torch.backends.cudnn.deterministic = True  # on a GPU: the same gradients both times
    plain = train(comm, "backward", algorithm, optimizer, dtype, steps, device=device, **layout)
    ahead = train(comm, "forward", algorithm, optimizer, dtype, steps, device=device, **layout)
    assert plain[4] == ahead[4] > 0, (plain[4], ahead[4])  # optimizer state, every param
    pairs = [(torch.tensor(plain[0]), torch.tensor(ahead[0]))]
    pairs += [(a, b) for step_a, step_b in zip(plain[1], ahead[1]) for a, b in zip(step_a, step_b)]
    pairs += list(zip(plain[2], ahead[2])) + list(zip(plain[3], ahead[3]))
    equal = all(torch.equal(a, b) for a, b in pairs)
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in pairs)
    moved = not torch.equal(plain[1][0][0], plain[2][0])  # the weights did change
    return equal, worst, moved, ahead[5]


def heads_reduced_early_equal_allreduce(comm, algorithm, dtype_name, device="cpu"):
    """forward_overlap_equals_allreduce with a bucket whose head is in 0.5 s before its
    last gradient: the chunks of its head go while backward is still on bn2."""
    return forward_overlap_equals_allreduce(comm, algorithm, "sgd", dtype_name, 4, device,
                                            buckets=HEAD_FIRST, slow_bn2=0.5)


class SlowAllReduce(AllReduce):
    """allreduce whose every chunk takes 50 ms: the communication outlasts backward."""

    def reduce_bucket(self, flat):
        time.sleep(0.05)
        super().reduce_bucket(flat)


def the_first_layer_runs_before_the_last_buckets_land(comm):
    """Rank 0's view when conv1 (the first layer, in the last bucket out of backward)
    starts its next forward: each bucket's elements still unreduced and where its
    reduced end starts, and each bucket's size."""
    torch.manual_seed(0)
    model = Net().double()
    ddp = DistributedDataParallel(model, comm=comm, **BUCKETS,
                                  sync=SlowAllReduce(algorithm="ring", overlap="forward",
                                                     chunk_mb=CHUNK_MB))
    stepper = ddp.step_in_forward(torch.optim.SGD(model.parameters(), lr=0.1))
    unreduced = []
    model.conv1.register_forward_pre_hook(  # registered after the stepper's: runs after it
        lambda module, inputs: unreduced.append((ddp.bucketer.priority.unreduced(),
                                                  list(ddp.bucketer.priority.reduced_from))))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    for _ in range(2):
        F.cross_entropy(ddp(x), torch.zeros(4, dtype=torch.int64)).backward()
        stepper.step()
        stepper.zero_grad()
        comm.barrier()  # the loop's own collective, while the buckets are on the wire
    ddp(x)
    sizes = [bucket.buffer.numel() for bucket in ddp.bucketer.buckets]
    stepper.close()
    ddp.bucketer.close()
    return unreduced[-1], sizes


def refusals(comm):
    """What overlap="forward" refuses, each with its message."""
    said = []
    model = Net().double()
    forward = sync.create("allreduce", overlap="forward")
    for attempt in (
            lambda: DistributedDataParallel(model, comm=comm, sync=forward,
                                            find_unused_parameters=True),
            lambda: DistributedDataParallel(Net(), comm=comm,
                                            sync=sync.create("allreduce", overlap="forward"))(
                torch.randn(2, 3, 6, 6)),
            lambda: DistributedDataParallel(
                Net(), comm=comm, sync=sync.create("allreduce", overlap="forward")
            ).step_in_forward(torch.optim.LBFGS(model.parameters())),
            lambda: sync.create("allreduce", overlap="sideways")):
        try:
            attempt()
            said.append(None)
        except (ValueError, RuntimeError) as error:
            said.append(str(error))
    return said


def a_deep_copy_of_the_model_evaluates(comm):
    """What the trainer does at each epoch's end: the step in flight finished, then a
    deep copy of the model (hooks and all) evaluated. The copy's output."""
    torch.manual_seed(0)
    model = Net().double()
    ddp = DistributedDataParallel(model, comm=comm, **BUCKETS,
                                  sync=AllReduce(overlap="forward", chunk_mb=CHUNK_MB))
    stepper = ddp.step_in_forward(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    F.cross_entropy(ddp(x), torch.zeros(4, dtype=torch.int64)).backward()
    stepper.step()
    stepper.flush()
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        out = twin(x)
    stepper.close()
    ddp.bucketer.close()
    return out.shape


# --- a step in flight, as a training loop meets it -----------------------------------
# Every path that reads or writes the weights, the buffers or the optimizer's state while
# overlap="forward" holds a step in flight, run as the same loop with plain allreduce.

class Loop:
    """One rank's loop of the tiny Net (float64, naive: every chunk sums in rank order,
    so both schedules give the same bits), with allreduce plain or overlap="forward"
    and SGD with momentum. `seen` records, in order, what the loop saw: each forward's
    output and the buffers after it, each evaluation, and at the end the weights,
    buffers and momentum."""

    def __init__(self, comm, overlap):
        torch.manual_seed(0)
        self.rank, self.forward = comm.rank, overlap == "forward"
        self.model = Net().double()
        self.ddp = DistributedDataParallel(
            self.model, comm=comm, **BUCKETS,
            sync=AllReduce(algorithm="naive", overlap=overlap, chunk_mb=CHUNK_MB))
        self.inner = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9,
                                     weight_decay=1e-2)
        self.optimizer = self.ddp.step_in_forward(self.inner) if self.forward else self.inner
        self.data = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own
        self.seen = []

    def record(self, what, tensors):
        self.seen += [(what, t.detach().clone()) for t in tensors]

    def forward_backward(self, scaler=None):
        x = torch.randn(4, 3, 6, 6, generator=self.data, dtype=torch.float64)
        y = torch.randint(0, 10, (4,), generator=self.data)
        out = self.ddp(x)
        self.record("training output", [out])
        self.record("buffers after a forward", self.model.buffers())
        loss = F.cross_entropy(out, y)
        (loss if scaler is None else scaler.scale(loss)).backward()

    def step(self):
        self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def flush(self):
        """overlap="forward": finish the step in flight (plain: nothing to do)."""
        if self.forward:
            self.optimizer.flush()

    def evaluate(self, through_ddp=True):
        """The output for one batch in eval mode under no_grad, and the buffers it used."""
        x = torch.randn(2, 3, 6, 6, generator=self.data, dtype=torch.float64)
        self.model.eval()
        with torch.no_grad():
            out = (self.ddp if through_ddp else self.model)(x)
        self.model.train()
        self.record("evaluation", [out])
        self.record("buffers of an evaluation", self.model.buffers())

    def checkpoint(self, of=None):
        """(model, optimizer) state_dicts, copied; `of`: the model's (default the DDP's)."""
        return copy.deepcopy(((of or self.ddp).state_dict(), self.optimizer.state_dict()))

    def end(self):
        state = self.optimizer.state_dict()["state"]  # by parameter index, in step order
        momentum = [state[index]["momentum_buffer"] for index in sorted(state)]
        self.record("final weights", self.model.parameters())
        self.record("final buffers", self.model.buffers())
        self.record("final momentum", momentum)
        if self.forward:
            self.optimizer.close()
        self.ddp.bucketer.close()
        return self.seen


def restore_the_model_then_the_optimizer(loop):
    """Roll back to a checkpoint (after a loss spike): the DDP's state_dict, then the
    optimizer's, loaded with a step in flight, then evaluated and trained on."""
    loop.step()
    loop.step()
    best = loop.checkpoint()
    loop.step()
    loop.step()
    loop.ddp.load_state_dict(best[0])
    loop.optimizer.load_state_dict(best[1])
    loop.evaluate()
    loop.step()
    loop.evaluate()


def restore_the_optimizer_then_the_module(loop):
    """The other order, into the wrapped module, evaluated on the module itself."""
    loop.step()
    loop.step()
    best = loop.checkpoint(of=loop.model)
    loop.step()
    loop.optimizer.load_state_dict(best[1])
    loop.model.load_state_dict(best[0])
    loop.evaluate(through_ddp=False)
    loop.step()
    loop.evaluate()


def restore_the_model_alone(loop):
    """Only the model's state (the optimizer goes on with its momentum)."""
    loop.step()
    best = loop.checkpoint()
    loop.step()
    loop.ddp.load_state_dict(best[0])
    loop.step()
    loop.evaluate()


def a_checkpoint_every_step(loop):
    """The model's and the optimizer's state_dict after every step: on rank 0 only at
    odd steps (as a loop that saves from rank 0), on every rank at even ones."""
    for step in range(4):
        loop.step()
        if step % 2 == 0 or loop.rank == 0:
            loop.checkpoint()
    loop.evaluate()


def accumulate_with_no_sync(loop):
    """Two micro-batches a step, the first inside no_sync()."""
    for _ in range(3):
        with loop.ddp.no_sync():
            loop.forward_backward()
        loop.forward_backward()
        loop.optimizer.step()
        loop.optimizer.zero_grad()
    loop.evaluate()


def evaluate_at_the_end_of_an_epoch(loop):
    """Evaluations between epochs, through the DDP and on the module, a step in flight."""
    loop.step()
    loop.step()
    loop.evaluate()
    loop.evaluate(through_ddp=False)
    loop.step()
    loop.evaluate(through_ddp=False)
    loop.step()
    loop.evaluate()


def steps_skipped_clipped_and_scaled(loop):
    """zero_grad() instead of step(); zero_grad() before step(); clipping and a
    GradScaler after flush() (the documented way: that step is plain allreduce's);
    a step with no zero_grad() after it (the next backward adds to the average)."""
    loop.forward_backward()
    loop.optimizer.zero_grad()  # the step skipped
    loop.step()
    loop.forward_backward()
    loop.optimizer.zero_grad()
    loop.optimizer.step()  # on what zero_grad() left: nothing
    loop.forward_backward()
    loop.flush()
    torch.nn.utils.clip_grad_norm_(loop.model.parameters(), 0.05)
    loop.optimizer.step()
    loop.optimizer.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    loop.forward_backward(scaler)
    loop.flush()
    scaler.step(loop.optimizer)
    scaler.update()
    loop.optimizer.zero_grad()
    loop.forward_backward()
    loop.optimizer.step()  # no zero_grad(): .grad keeps the average
    loop.step()
    loop.evaluate()


PENDING_STEP_SCENARIOS = (restore_the_model_then_the_optimizer,
                          restore_the_optimizer_then_the_module, restore_the_model_alone,
                          a_checkpoint_every_step, accumulate_with_no_sync,
                          evaluate_at_the_end_of_an_epoch, steps_skipped_clipped_and_scaled)


def a_step_in_flight_sees_what_plain_allreduce_sees(comm):
    """Each scenario run with plain allreduce and with overlap="forward": for each,
    None if everything seen was bitwise equal, else the first difference."""
    differences = {}
    for scenario in PENDING_STEP_SCENARIOS:
        runs = []
        for overlap in ("backward", "forward"):
            loop = Loop(comm, overlap)
            scenario(loop)
            runs.append(loop.end())
        plain, ahead = runs
        differences[scenario.__name__] = next(
            (f"{what} #{index}: {float((a - b).abs().max()):.4g} apart"
             for index, ((what, a), (_, b)) in enumerate(zip(plain, ahead))
             if not torch.equal(a, b)),
            None if [w for w, _ in plain] == [w for w, _ in ahead] else "other records")
    return differences


def what_cannot_be_right_is_refused(comm):
    """With a step in flight: GradScaler's step on the stepper and on the optimizer it
    wraps, clip_grad_norm_ before step(), the wrapped optimizer stepped itself. Each
    attempt's error (None if it went through); the step is then finished and dropped."""
    loop = Loop(comm, "forward")
    params = list(loop.model.parameters())
    attempts = {
        "GradScaler on the stepper": lambda s: s.step(loop.optimizer),
        "GradScaler on the optimizer": lambda s: s.step(loop.inner),
        "clip_grad_norm_": lambda s: (torch.nn.utils.clip_grad_norm_(params, 0.05),
                                      loop.optimizer.step()),
        "the optimizer itself": lambda s: loop.inner.step(),
    }
    said = {}
    for name, attempt in attempts.items():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        loop.forward_backward(scaler if name.startswith("GradScaler") else None)
        try:
            attempt(scaler)
            said[name] = None
        except RuntimeError as error:
            said[name] = str(error)
        loop.optimizer.flush()
        loop.optimizer.zero_grad()
    loop.end()
    return said


def nothing_stays_on_the_model(comm):
    """A wrapper refused at construction, and one closed, leave no hook on the model: it
    loads, saves and runs as a bare module. Returns the hooks left after each."""
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    hooks = lambda: sum(len(m._load_state_dict_pre_hooks) + len(m._forward_pre_hooks)
                        + len(m._state_dict_pre_hooks) for m in net.modules())
    try:
        DistributedDataParallel(net, comm=comm, sync="allreduce:overlap=forward",
                                find_unused_parameters=True)
    except ValueError:
        pass
    refused = hooks()
    net.load_state_dict(net.state_dict())
    ddp = DistributedDataParallel(net, comm=comm, sync="allreduce:overlap=forward")
    optimizer = ddp.step_in_forward(torch.optim.SGD(net.parameters(), lr=0.1))
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    ddp.close()  # the step in flight is taken, then every hook comes off
    net.load_state_dict(net.state_dict())
    net(torch.randn(8, 4))
    return refused, hooks()
