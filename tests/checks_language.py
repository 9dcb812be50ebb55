"""Per-rank runs of the trainer on the language model (run by test_language_model.py on
spawned gloo ranks), in process as checks_trainer.py runs the image task."""
import contextlib
import io
import json
import os

from checks_trainer import straight_and_resumed, trainer_on
from trainer.loop import train


def both_tasks(comm, folder, text_dir):
    """One image run and one language-model run through the same loop. Returns (on rank
    0) each run's records and what it printed; the language model's TensorBoard tags."""
    runs = {"images": ["--train-samples", "64", "--test-samples", "32", "--epochs", "2",
                       "--batch-size", "8"],
            "language": ["--model", "gpt-nano", "--dataset", "text", "--data-dir", text_dir,
                         "--steps", "60", "--eval-every", "20", "--batch-size", "8",
                         "--test-samples", "64",
                         "--tensorboard", os.path.join(folder, "board")]}
    results = {}
    for task, flags in runs.items():
        metrics = os.path.join(folder, f"{task}.jsonl")
        printed = io.StringIO()
        with trainer_on(comm), contextlib.redirect_stdout(printed):
            train.train([*flags, "--metrics", metrics, "--progress", "off"])
        comm.barrier()
        if comm.rank == 0:
            with open(metrics) as lines:
                results[task] = {"records": [json.loads(line) for line in lines],
                                 "printed": printed.getvalue()}
    if comm.rank == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        board = EventAccumulator(os.path.join(folder, "board"))
        board.Reload()
        results["tags"] = sorted(board.Tags()["scalars"])
        results["train_steps"] = [event.step for event in board.Scalars("train/loss")]
    return results


def resumed_language_runs(comm, folder, text_dir, cases):
    """straight_and_resumed for each (name, flags) of `cases` on the language model, one
    after another in this world; folder/<name>/ holds each case's checkpoints."""
    for name, flags in cases:
        common = ["--model", "gpt-nano", "--dataset", "text", "--data-dir", text_dir,
                  "--batch-size", "4", "--test-samples", "8", "--progress", "off", *flags]
        case_folder = os.path.join(folder, name.replace(" ", "_"))
        with contextlib.redirect_stdout(io.StringIO()):
            straight_and_resumed(comm, case_folder, common, epochs=None)
        comm.barrier()
    return "ok"
