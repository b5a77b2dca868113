"""The run's seeds (`jaxdp.noise.seeds`): derived seeds fixed across versions, independent per path, never from a
guessable root by accident, NumPy only."""

import numpy as np
import pytest

from jaxdp.noise import seeds


def test_derived_seeds_are_those_of_every_earlier_version():
    """A resumed run re-derives its noise key and batches from the checkpoint's root: the derivation (its salt
    and encoding) must never change, even when the code moves (values from the first version, in noise.py)."""
    assert seeds.derive_seed(12345, seeds.NOISE) == 0xd7401098f41bb3b29978cf0cda921da78abb5504c08d4585040ff219094206c
    assert seeds.derive_seed(12345, "sampler", 0, 1) == (
        0xd7c91082d7e9b45e7b4a7779b0f3f10e96a49cb3f6a42ad8132b65eb9cf1f52)


def test_each_path_its_own_stream():
    paths = [(seeds.NOISE,), (seeds.SAMPLER,), (seeds.INIT,), (seeds.SAMPLES, 0), (seeds.SAMPLES, 1),
             ("1",), (1,), (seeds.SAMPLER, 0, 1), (seeds.SAMPLER, 1, 0), ()]
    root = seeds.secret_seed()
    derived = [seeds.derive_seed(root, *p) for p in paths]
    assert len(set(derived)) == len(paths)  # "1" and 1 differ, and (0, 1) is not (1, 0)
    assert all(0 <= d < 2**256 for d in derived)
    with pytest.raises(TypeError):
        seeds.derive_seed(root, 1.5)
    with pytest.raises(TypeError):
        seeds.derive_seed(root, True)


def test_secret_seeds_are_not_guessable():
    drawn = [seeds.secret_seed() for _ in range(64)]
    assert len(set(drawn)) == 64 and not any(map(seeds.guessable_seed, drawn))  # each below 2^64 w.p. 2^-64
    assert seeds.guessable_seed(42) and not seeds.guessable_seed(2**64)
    assert list(seeds.seed_words(2**32 + 7, 3)) == [7, 1, 0] and seeds.seed_words(1, 2).dtype == np.uint32
