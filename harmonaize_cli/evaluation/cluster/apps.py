"""How much work each Pollux application is: the workloads give no job length, so a job's duration comes from a
stated amount of work divided by its simulated throughput.

The Pollux simulator (petuum/adaptdl, branch osdi21-artifact, `simulator/applications.py`) ends a job after a fixed
number of epochs per application (`max_epochs`; no target metric is set) and measures progress per epoch from its
`traces/<app>/validation-*.csv`. Here a job's work is that many epochs of its training set, in samples:

    work = epochs x samples per epoch

Samples per epoch are the datasets' sizes, checked against those traces (one epoch's `iteration` count times the
trace's batch size, or its `progress` per epoch times the batch size one unit of progress stands for). Our code is
our own; only these numbers come from there.

Simplification: no statistical-efficiency model. Pollux discounts a large batch's progress by its measured gradient
noise (`goodput`); here a sample is a sample at any batch size. Every arm uses the same model, so it favours none,
and the elastic arms keep the job's global batch where the throughput table allows (`throughput.local_batch`), so
they do not gain from batches Pollux would discount.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["APPS", "AppWork", "work_samples"]


@dataclass(frozen=True)
class AppWork:
    """One application's training run to completion, and where each number comes from."""

    name: str
    model: str
    dataset: str
    epochs: int
    samples_per_epoch: int
    source: str

    @property
    def work(self) -> float:
        return float(self.epochs * self.samples_per_epoch)


APPS: dict[str, AppWork] = {a.name: a for a in (
    AppWork("bert", "BERT-base fine-tuning", "SQuAD v1.1 (88,641 training features)", 2, 88_641,
            "max_epochs=2; validation-12.csv: 7,387 iterations/epoch x 12 = 88,644"),
    AppWork("cifar10", "ResNet-18", "CIFAR-10 (50,000 training images)", 100, 50_000,
            "max_epochs=100; validation-*.csv: 390.6 progress/epoch x 128 (the trace's initial batch) = 50,000"),
    AppWork("deepspeech2", "DeepSpeech2", "CMU-ARCTIC (about 7,150 training utterances)", 80, 7_150,
            "max_epochs=80; validation-*.csv: 357.8 progress/epoch x 20 (initial batch) = 7,156; late epochs: "
            "45 iterations x 160 = 7,200, 12 x 640 = 7,680 (last batch partial)"),
    AppWork("imagenet", "ResNet-50", "ImageNet-1k (1,281,167 training images)", 90, 1_281_167,
            "max_epochs=90; validation-200.csv: 6,405-6,406 iterations/epoch x 200 = 1,281,200"),
    AppWork("ncf", "Neural Collaborative Filtering", "MovieLens with 4 negatives per rating (4,971,008 samples)",
            10, 4_971_008, "max_epochs=10; validation-256.csv: 19,418 iterations/epoch x 256 = 4,971,008"),
    AppWork("yolov3", "YOLOv3", "PASCAL VOC 2007+2012 trainval (16,551 images)", 50, 16_551,
            "max_epochs=50; validation-8.csv: 2,069 iterations/epoch x 8 = 16,552"),
)}


def work_samples(app: str) -> float:
    """Samples a job of `app` processes before it completes."""
    try:
        return APPS[app].work
    except KeyError:
        raise ValueError(f"unknown application {app!r}: known are {sorted(APPS)}") from None
