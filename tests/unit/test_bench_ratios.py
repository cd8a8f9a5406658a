"""The bench's verdict on "one download per node": 8 readers of a file fetch what one
reader fetches, the next file's first chunks (fetched ahead, decision 0015) included."""

from ckptfs.bench.runner import ratios


def verdict(one: float, eight: float) -> str:
    summary = {"medians": {"ckptfs-sync": {"1_readers_fetched_x": one,
                                           "8_readers_fetched_x": eight}}}
    return next(line for line in ratios(summary) if "/ one reader's" in line)


def test_eight_readers_fetching_what_one_fetches_is_one_download():
    assert verdict(1.0625, 1.0625).endswith("ok")


def test_eight_readers_fetching_more_than_one_is_missed():
    assert verdict(1.0625, 1.5).endswith("MISSED")
    assert verdict(1.0625, 8.5).endswith("MISSED")


def test_small_file_copies_are_judged_against_the_passthrough():
    """Issue 25: async cp -a / tar x within 2x the bare passthrough; sync is stated."""
    summary = {"medians": {"passthrough": {"small_cp_a": 2.0, "small_tar_x": 2.0},
                           "local": {"small_cp_a": 0.1, "small_tar_x": 0.1},
                           "ckptfs-async": {"small_cp_a": 3.0, "small_tar_x": 5.0},
                           "ckptfs-sync": {"small_cp_a": 30.0}}}
    lines = ratios(summary)
    line = {text.split("  ")[1].strip(): text for text in lines}
    assert line["async: small files cp -a / passthrough"].endswith("ok")
    assert line["async: small files tar x / passthrough"].endswith("MISSED")
    assert " 15.00 " in line["sync: small files cp -a / passthrough"]
    assert "(target -)" in line["sync: small files cp -a / passthrough"]
    assert " 30.00 " in line["async: small files cp -a / local disk"]
