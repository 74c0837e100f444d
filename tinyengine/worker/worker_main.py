"""A tensor-parallel worker process (ranks 1..N-1):
`python -m tinyengine.worker.worker_main RANK SIZE PORT CONFIG ERRFILE PARENT`.

Owns the worker's side of worker/worker_group.py's protocol. The worker
joins the process groups, builds its own StartupStages for the pickled
EngineConfig (its model shard: tp_group() says which), then obeys rank 0's
commands until told to stop:

  ("stage", name, args)  run a startup stage (worker/lockstep.py's
                          run_stage) and exchange the results
  ("step", StepInputs)    run the step's forward (ModelRunner.forward_step)
                          and, with asynchronous scheduling, receive the ids
                          rank 0 sampled, for the next step's inputs
  ("shutdown",)           leave

It holds no scheduler, tokenizer or request: a step is plain data. An error
while serving is fatal (rank 0 cannot know how far this rank got): its text
goes to ERRFILE for rank 0's message, and the process exits: that breaks
any collective the other ranks wait in, and so does an error in a startup
stage (worker/lockstep.py says why). A watchdog
ends the process if rank 0 (PARENT) goes away.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tinyengine.worker.lockstep import run_stage
from tinyengine.worker.stages import StartupStages
from tinyengine.worker.worker_group import init_groups


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def serve(rank: int, size: int, port: int, config_path: str, ready: Path) -> None:
    config = pickle.loads(Path(config_path).read_bytes())
    device = config.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    ready.touch()  # rank 0 now waits in the rendezvous instead of watching this process
    meta = init_groups(rank, size, port, device)
    stages = StartupStages.for_config(config)
    runner = stages.runner
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=meta)
        command = box[0]
        kind = command[0]
        if kind == "shutdown":
            break
        if kind == "stage":
            _, name, args = command
            result = run_stage(stages, rank, name, args)
            dist.all_gather_object([None] * size, result, group=meta)
        elif kind == "step":
            inputs = command[1]
            logits, _, _ = runner.forward_step(inputs)
            if logits is not None and config.async_scheduling:
                num = len(inputs.logits_rows)
                tokens = torch.empty(num, dtype=torch.long, device=runner.device)
                dist.broadcast(tokens, src=0)
                runner.remember_sampled(tokens, [])
        else:
            raise ValueError(f"unknown command {kind!r} from rank 0")
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    rank, size, port = int(argv[0]), int(argv[1]), int(argv[2])
    config_path, error_path, parent = argv[3], Path(argv[4]), int(argv[5])
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    code = 0
    try:
        with torch.inference_mode():
            serve(rank, size, port, config_path, error_path.with_suffix(".ready"))
    except BaseException as exc:
        error_path.write_text(f"rank {rank}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        code = 1
    # No interpreter finalization: gloo's worker thread may still free a
    # finished collective's tensors then, without the GIL, and abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
