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
