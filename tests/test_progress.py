"""What a person sees while a job runs: a bar that moves every batch, and one line saying what is coming."""

from extract.job.progress import JobProgress
from extract.store.chunks import Plan


class DoneMarkers:
    """The part of a store the bar reads: which of some chunks have their ``done`` object."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.integrity = self  # the store asks its integrity which objects exist

    def stored_chunks(self, name: str, chunks: set[int]) -> set[int]:
        assert name == "done"
        return self.done & set(chunks)


def test_the_bar_counts_own_batches_at_once_and_the_other_ranks_chunks_when_marked():
    plan, store = Plan(100, 10), DoneMarkers()
    progress = JobProgress(store, plan, list(range(10)), enabled=True, interval=3600, own=[0, 1, 2, 3, 4])
    progress.advance(4)  # one batch of this rank: the bar moves before any chunk is complete
    assert progress.bar.n == 4
    store.done.update({0, 5, 6})  # chunk 0 is this rank's own: already counted batch by batch
    progress.refresh()
    assert progress.bar.n == 4 + 20
    progress.advance(46)
    store.done.update(range(10))
    progress.refresh()
    assert progress.bar.n == 100 == progress.bar.total
    progress.close()


def test_one_line_before_the_loop_says_what_is_coming(cli):
    code, _, err = cli("--model", "resnet18", "--weights", "none", "--layers", "layer3", "layer4", "--pool",
                       "layer4=avg", "--image-size", "32", "--data", "synthetic:40", "--chunk-size", "40",
                       "--num-workers", "0", "--out", __import__("tempfile").mkdtemp() + "/p.zarr")  # fmt: skip
    assert code == 0, err
    lines = [line for line in err.splitlines() if "before compression" in line]
    assert lines == [
        "extract: layer3 (256, 2, 2), layer4 (512,) as float16; 40 samples in 1 chunk of 40; 1 process; "
        f"{40 * (256 * 4 + 512) * 2 / 2**20:.1f} MiB before compression"
    ]
    assert "1 chunk written, 0 reused" in err
