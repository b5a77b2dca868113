"""`bench_throughput`'s `auto_merged`: auto without `jaxdp.core.rows.rows_apart`'s barriers, for its A/B on a GPU.

In the library so that a test imports it without bench_throughput's absl flags."""

import contextlib


@contextlib.contextmanager
def rows_merged():
    """While tracing: rows of the noise draws and clip factors as plain slices, no barrier each.

    XLA:GPU may then merge the updates of all leaves that read one array into one kernel, as it did before.
    Trace only a fresh jitted function inside it: jit keeps a program traced here for later calls."""
    from unittest import mock

    from jaxdp.core import rows as rows_lib

    def rows(stacked):
        return [stacked[j] for j in range(stacked.shape[0])]

    with mock.patch.object(rows_lib, "rows_apart", rows):
        yield
