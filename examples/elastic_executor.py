"""An elastic kolo.Executor (horovod.ray's elastic executor): workers fit a
linear model with kolo.elastic, and keep going in place when one of them
fails. `--fail-on HOST:STEP` makes the worker on HOST exit at STEP, to
watch the job survive it.

    python examples/elastic_executor.py --engine local --hosts a:1,b:1,c:1 --fail-on c:50
    salloc -N3 python examples/elastic_executor.py --fail-on <a node>:50

It prints each membership change, rank 0's loss every 20 steps, then each
process of the last round: its rank, host, step and loss.
"""

import argparse
import os

import kolo


def train(steps, fail_on, lr=0.05):
    import numpy as np

    import kolo

    # the same data everywhere; each round's ranks take their share
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 8))
    y = x @ np.arange(1.0, 9.0) + 0.1 * rng.normal(size=4096)
    host = os.environ["HOROVOD_HOSTNAME"]
    state = kolo.elastic.ObjectState(step=0, w=np.zeros(8))

    def loss(w):
        return float(np.mean((x @ w - y) ** 2))

    @kolo.elastic.run
    def loop(state, comm):
        while state.step < steps:
            if fail_on == (host, state.step):
                os._exit(3)
            xs, ys = x[comm.rank :: comm.size], y[comm.rank :: comm.size]
            grad = 2 * xs.T @ (xs @ state.w - ys) / len(xs)
            state.w = state.w - lr * comm.allreduce(grad, op="avg")
            state.step += 1
            state.commit()
            if state.step % 20 == 0:
                kolo.report({"step": state.step, "loss": loss(state.w), "size": comm.size})
        return comm.rank, host, state.step, loss(state.w)

    return loop(state)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", help="kolo's host list (h1:2,h2:2); default: the Slurm allocation's nodes")
    parser.add_argument("--engine", choices=["local", "ssh", "slurm"])
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fail-on", metavar="HOST:STEP", help="the worker on HOST exits at STEP")
    args = parser.parse_args()
    fail_on = None
    if args.fail_on:
        host, _, step = args.fail_on.rpartition(":")
        if not host or not step.isdigit():
            parser.error(f"--fail-on takes HOST:STEP, got {args.fail_on!r}")
        fail_on = (host, int(step))

    settings = kolo.Executor.create_settings(timeout_s=60)
    executor = kolo.Executor(
        settings,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        hosts=args.hosts,
        engine=args.engine,
    )
    with executor:
        executor.start()
        results = executor.run(
            train,
            args=[args.steps, fail_on],
            callbacks=[lambda r: print(f"step {r['step']}: loss {r['loss']:.6f} on {r['size']} workers", flush=True)],
            on_event=lambda e: print(e["message"], flush=True),
        )
    for rank, host, step, loss in results:
        print(f"rank {rank} on {host}: step {step}, loss {loss:.6f}")


if __name__ == "__main__":
    main()
