"""Where the compiler schedules the sharded step's collectives, DP vs non-DP (compile only).

    python -m experiments.collective_schedule --target=h100 --models=llama-tiny --seq=4 --remat=full
    XLA_FLAGS="--xla_gpu_reduce_scatter_combine_threshold_bytes=0 --xla_gpu_all_reduce_combine_threshold_bytes=0" \\
        python -m experiments.collective_schedule --target=h100 --models=llama-tiny --seq=4 --remat=full

For DP by each method (`ShardedDPStep(method=...)`) and non-DP
(`NonPrivate`) on a (1, seq) mesh, the step is compiled and its scheduled
entry computation read: for each collective kind, the asynchronous
start / done pairs, the most operands one pair carries (the combiner merges
independent collectives into one), and how many compute instructions
(fusions, custom calls such as GEMMs) the scheduler put between a start and
its done: the work that collective can overlap with. It says where the
overlap CAN happen, not how long anything takes. `--target=h100` is
`experiments.long_context`'s deviceless XLA:GPU compile (see there for the
CUDA plugin it needs); without it, this machine's backend (XLA:CPU issues
synchronous collectives: no pairs).
"""

from __future__ import annotations

from absl import app, flags

from experiments import long_context
from jaxdp.analysis import collectives as collectives_lib
from jaxdp.sharding import longest_context

# The model, mesh, remat, dtype and target flags are long_context's (--models, --seq, --remat, --dtype,
# --target): every combination gets a table.
SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "tokens per example")


def schedule(model: str, seq: int, T: int, remat: str, dtype: str, target: str | None, private: bool,
             method: str = "bookkeeping") -> list[dict]:
    from flax import nnx

    from jaxdp.analysis.hlo_cost import target_devices
    from jaxdp.sharding import make_mesh

    mesh = make_mesh(1, seq, devices=target_devices(target, seq))
    step, build = longest_context.make_step(longest_context.make_model(model, T, dtype, remat), private, mesh, 1, 0,
                                            method)
    state = nnx.eval_shape(lambda: step.init(build()))
    return collectives_lib.collective_pairs(step.lower(state, longest_context.make_batch(1, T)).compile().as_text())


def main(argv):
    del argv
    lc = long_context
    for model in lc.MODELS.value:
        for seq in map(int, lc.SEQ.value):
            for remat in lc.REMATS.value:
                args = (model, seq, SEQ_LEN.value, remat, lc.DTYPE.value, lc.TARGET.value)
                rows = {"non-DP": schedule(*args, private=False),
                        "DP book-keeping": schedule(*args, private=True, method="bookkeeping"),
                        "DP two-pass": schedule(*args, private=True, method="two_pass")}
                print(f"\n{model}, T = {SEQ_LEN.value}, mesh 1 x {seq}, remat {remat}, {lc.DTYPE.value}, "
                      f"target {lc.TARGET.value or 'this machine'}")
                print(collectives_lib.schedule_table(rows), flush=True)


if __name__ == "__main__":
    app.run(main)
