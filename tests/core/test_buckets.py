"""The prefill ladder and the choice of a bucket."""

from __future__ import annotations

import pytest

from graphcap.core.buckets import check_ladder, pick_bucket, prefill_ladder


def test_the_default_ladder_has_42_shapes_up_to_2048():
    ladder = prefill_ladder(2048)
    assert len(ladder) == 42
    assert ladder[:8] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert ladder[8:10] == [48, 64] and ladder[-5:] == [1024, 1280, 1536, 1792, 2048]


def test_the_ladder_ends_at_max_tokens_and_steps_by_512_past_4096():
    assert prefill_ladder(100)[-2:] == [96, 100]
    assert prefill_ladder(6000)[-4:] == [4608, 5120, 5632, 6000]


def test_a_ladder_of_more_than_1074_shapes_is_refused_before_it_is_built():
    assert len(prefill_ladder(4096 + 512 * 1024)) == 1074
    with pytest.raises(ValueError, match=r"max_tokens=1099511627776 would capture "
                                         r"2147483690 shapes .* give buckets="):
        prefill_ladder(2**40)  # a list of two billion sizes: the process was killed
    with pytest.raises(ValueError, match="would capture 1075 shapes"):  # and itself
        prefill_ladder(4096 + 512 * 1024 + 1)


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    assert pick_bucket(5, [4, 8, 16]) == (8, None)
    assert pick_bucket(16, [4, 8, 16]) == (16, None)


def test_batches_past_the_largest_bucket_or_padded_over_twice_run_eagerly():
    assert pick_bucket(17, [4, 8, 16]) == (None, "too_many_tokens")
    assert pick_bucket(3, [8, 16]) == (None, "padding")


def test_user_buckets_are_checked():
    assert check_ladder([16, 4, 8, 8]) == [4, 8, 16]
    with pytest.raises(ValueError, match="positive"):
        check_ladder([0, 4])
    for bad in (["a"], [4.7, 8], [8.0], [True, 4], "48", 16):
        with pytest.raises(ValueError, match="integer"):  # never rounded, never parsed
            check_ladder(bad)
