"""Uneven micro-batch counts per data replica (`replica_microbatches`): replica r runs its own
number of micro-batch slots, the rest padding its devices skip (sf.predicated), and the step's
losses equal the homogeneous step's over the same global batch."""

import numpy as np
import pytest
from test_models import small_config

from shardflow import train
from shardflow.train import config, uneven


def test_slots_place_each_replicas_rows_and_weigh_the_padding_zero():
    index, weight = uneven.slots([3, 1], rows=2)
    assert index.shape == weight.shape == (3, 4)
    np.testing.assert_array_equal(weight, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    real = index[weight > 0]
    assert sorted(real) == list(range(8))  # every row of the global batch once
    np.testing.assert_array_equal(index[:, :2].ravel(), [0, 1, 2, 3, 4, 5])  # replica 0: rows 0-5
    np.testing.assert_array_equal(index[0, 2:], [6, 7])  # replica 1: rows 6-7, in its first slot


@pytest.mark.slow
def test_uneven_replicas_follow_the_homogeneous_loss(data_dir, tmp_path):
    """{data: 4, model: 2}, the replicas taking 3, 3, 1 and 1 micro-batches of 2 rows (16 rows a
    step): three steps' losses equal the homogeneous step's on the same 16 rows."""
    base = dict(strategy="tp", mesh={"data": 4, "model": 2}, compute_dtype="float32", batch_size=16)
    want = train.train(small_config(data_dir, tmp_path / "even", **base), progress=False)["losses"]
    cfg = small_config(data_dir, tmp_path / "uneven", **base, replica_microbatches=[3, 3, 1, 1])
    got = train.train(cfg, progress=False)["losses"]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=1e-5)


@pytest.mark.parametrize(
    "counts, message",
    [
        ([3, 3, 1], r"one count per data replica; the mesh's data axes make 4"),
        ([3, 3, 1, 0], r"a list of positive integers"),
        ([3, 3, 2, 1], r"batch_size 16 is not divisible by their sum 9"),
    ],
)
def test_bad_counts_are_one_config_error_naming_them(counts, message, data_dir, tmp_path):
    cfg = small_config(
        data_dir, tmp_path, strategy="tp", mesh={"data": 4, "model": 2}, batch_size=16, replica_microbatches=counts
    )
    with pytest.raises(config.ConfigError, match=rf"replica_microbatches \[.*\]: {message}"):
        config.validate(cfg, 8)
