"""One-run privacy audit (`python -m experiments.audit`): the default pretraining config plus `audit`.

Black box (the default): random-token canaries join the default CPU run's
training windows, scored by their loss drop. White box: gradient canaries on a
tiny softmax regression through the same DP step (`jaxdp.auditing.runs`).
"""

from ml_collections import config_dict

from experiments.configs import default


def get_config() -> config_dict.ConfigDict:
    c = default.get_config()
    with c.unlocked():
        c.dp.delta = 1e-5                    # the audited claim's delta (fixed: the default would follow N)
        c.dp.target_epsilon = 2.0            # the audited claim: below what m canaries can show (m = 1000: 4.75)
        c.audit = config_dict.ConfigDict()
        c.audit.kind = "black_box"           # "black_box" (LM, random-token canaries) | "white_box" (gradient canaries)
        c.audit.num_canaries = 1000          # m; each is trained on with probability 1/2
        c.audit.bug = "none"                 # planted bug the claim ignores: "none" | "half_noise" | "no_clipping"
        c.audit.confidence = 0.95            # of the epsilon lower bound
        c.audit.max_windows = config_dict.placeholder(int)  # black box: first N training windows (None: all)
        c.audit.white_box_steps = 4          # white box: full-batch DP-SGD steps
        c.audit.white_box_examples = 32      # white box: synthetic data records besides the canaries
        c.audit.white_box_sampling_rate = 1.0  # white box: Poisson rate q of every record (1: full batch)
        c.audit.record_in = config_dict.placeholder(str)  # a DP run's workdir: its privacy.json gets the bound
    c.lock()
    return c
