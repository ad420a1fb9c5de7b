"""Properties of data/sharding.py over a grid of world sizes W, workers K and dataset sizes N, in one
process (ranks are constructor arguments, workers are emulated or real DataLoader workers)."""

import itertools
from collections import Counter
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.errors import PlanError
from data.sharding import BatchPlan, ShardedIterableDataset, check_same_plan
from data.shards import shards_in, write_shards
from data.sources import DatasetsSource, ParquetSource, TensorSource

WORLD_SIZES = range(1, 9)
WORKERS = range(0, 5)
SIZES = [0, 1, 7, 100, 1001]
PER_RANK_BATCH = [1, 3, 8]


def source(n, unit_size=1):
    return TensorSource({"x": torch.arange(n) * 10, "y": torch.arange(n) % 7}, unit_size=unit_size)


def worker_outputs(dataset, num_workers):
    """What each of K workers yields, and the order a DataLoader hands the batches back in (round
    robin over workers, skipping finished ones)."""
    per_worker = []
    for k in range(max(num_workers, 1)):
        info = mock.Mock(id=k, num_workers=num_workers, dataset=dataset) if num_workers else None
        with (
            mock.patch("data.sharding.get_worker_info", return_value=info),
            mock.patch(f"{__name__}.get_worker_info", return_value=info),
        ):  # for the controls below
            per_worker.append(list(dataset))
    merged, cursors = [], [iter(w) for w in per_worker]
    while cursors:
        for c in list(cursors):
            item = next(c, None)
            if item is None:
                cursors.remove(c)
            else:
                merged.append(item)
    return per_worker, merged


def run_ranks(n, world, workers, per_rank, policy="pad", seed=0, epoch=0, unit_size=1, start=0):
    """Each rank's batches for one epoch, as lists of (index tensor, valid tensor)."""
    ranks = []
    for r in range(world):
        ds = ShardedIterableDataset(source(n, unit_size), per_rank * world, r, world, seed=seed, policy=policy)
        ds.set_epoch(epoch, start)
        _, merged = worker_outputs(ds, workers)
        ranks.append([(b["index"], b["valid"]) for b in merged])
    return ranks


def global_batches(ranks):
    """Global batch b = the concatenation of every rank's batch b."""
    return [torch.cat([r[b][0] for r in ranks]) for b in range(len(ranks[0]))]


def valid_ids(ranks):
    return [int(i) for r in ranks for idx, valid in r for i in idx[valid]]


def assert_exactly_once(ranks, n, g, policy):
    ids = valid_ids(ranks)
    counts = Counter(ids)
    assert all(c == 1 for c in counts.values()), "a sample appears twice"
    expected = n if policy == "pad" else (n // g) * g
    assert len(ids) == expected, f"{len(ids)} samples seen, expected {expected}"
    assert all(0 <= i < n for i in ids)


GRID = [
    (n, w, k, b, p)
    for n, w, k, b, p in itertools.product(SIZES, WORLD_SIZES, WORKERS, PER_RANK_BATCH, ["drop", "pad"])
    if not (p == "drop" and 0 < n < w * b)
]


@pytest.mark.parametrize("n,world,workers,per_rank,policy", GRID)
def test_coverage_equal_counts_and_worker_invariance(n, world, workers, per_rank, policy):
    ranks = run_ranks(n, world, workers, per_rank, policy, unit_size=4)
    assert_exactly_once(ranks, n, world * per_rank, policy)
    assert len({len(r) for r in ranks}) == 1, "ranks yield different batch counts: DDP would hang"
    assert all(len(idx) == per_rank for r in ranks for idx, _ in r)
    if workers:  # the rank's order does not depend on K
        single = run_ranks(n, world, 0, per_rank, policy, unit_size=4)
        assert all(
            torch.equal(a[0], b[0]) for r1, r2 in zip(ranks, single, strict=True) for a, b in zip(r1, r2, strict=True)
        )


@pytest.mark.parametrize("n", [0, 7, 100, 1001])
@pytest.mark.parametrize("policy", ["drop", "pad"])
@pytest.mark.parametrize("global_batch", [8, 24])
def test_global_batches_are_the_same_for_any_world_size(n, policy, global_batch):
    if policy == "drop" and 0 < n < global_batch:
        with pytest.raises(PlanError, match="fewer than one global batch"):
            run_ranks(n, 1, 0, global_batch, policy)
        return
    reference = [set(b.tolist()) for b in global_batches(run_ranks(n, 1, 0, global_batch, policy, seed=5))]
    for world in (2, 4, 8):
        if global_batch % world:
            continue
        got = [set(b.tolist()) for b in global_batches(run_ranks(n, world, 3, global_batch // world, policy, seed=5))]
        assert got == reference


def test_worker_utilisation_every_worker_gets_batches():
    ds = ShardedIterableDataset(source(1000), 16, rank=1, world_size=2)
    per_worker, _ = worker_outputs(ds, 4)
    assert all(len(w) >= len(ds) // 4 for w in per_worker)


def test_each_epoch_shuffles_differently_and_identically_on_every_rank():
    e0 = global_batches(run_ranks(100, 2, 0, 5, epoch=0, seed=1))
    e1 = global_batches(run_ranks(100, 2, 0, 5, epoch=1, seed=1))
    again = global_batches(run_ranks(100, 2, 2, 5, epoch=1, seed=1))  # fresh objects, as on another rank
    assert not all(torch.equal(a, b) for a, b in zip(e0, e1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(e1, again, strict=True))
    other_seed = global_batches(run_ranks(100, 2, 0, 5, epoch=1, seed=2))
    assert not all(torch.equal(a, b) for a, b in zip(e1, other_seed, strict=True))


@pytest.mark.parametrize(
    "n,world,per_rank,policy,new_world",
    [
        (100, 2, 5, "pad", 2),
        (100, 2, 5, "drop", 1),
        (201, 4, 4, "pad", 8),
        (201, 4, 4, "drop", 2),
        (7, 1, 2, "pad", 2),
        (37, 3, 2, "pad", 6),
    ],
)  # 201 rows: a partial last global batch of 16, as 1001 had, in 13 cut points instead of 63
def test_resume_at_every_cut_point_also_with_another_world_size(n, world, per_rank, policy, new_world):
    g = world * per_rank
    full = run_ranks(n, world, 0, per_rank, policy, seed=9, epoch=3)
    for cut in range(len(full[0]) + 1):
        seen = [r[:cut] for r in full]
        states = []
        for r in range(world):  # state_dict after consuming `cut` batches, on every rank
            ds = ShardedIterableDataset(source(n), g, r, world, seed=9, policy=policy)
            ds.set_epoch(3)
            states.append(ds.state_dict(next_batch=cut))
        assert all(s == states[0] for s in states), "ranks would save different positions"
        rest = []
        for r in range(new_world):
            ds = ShardedIterableDataset(source(n), g, r, new_world, seed=9, policy=policy)
            ds.load_state_dict(states[0])
            _, merged = worker_outputs(ds, 2)
            rest.append([(b["index"], b["valid"]) for b in merged] if states[0]["epoch"] == 3 else [])
        seen_ids, rest_ids = valid_ids(seen), valid_ids(rest)
        assert not set(seen_ids) & set(rest_ids), f"cut {cut}: samples seen twice"
        assert sorted(seen_ids + rest_ids) == sorted(valid_ids(full)), f"cut {cut}: samples lost"


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than the 2 cores: on purpose
def test_real_dataloader_with_workers_matches_the_plan():
    for world, workers in [(2, 2), (3, 4), (1, 3)]:
        ranks = []
        for r in range(world):
            ds = ShardedIterableDataset(source(1001, unit_size=8), 8 * world, r, world, seed=4, policy="pad")
            ds.set_epoch(2)
            loader = DataLoader(ds, batch_size=None, num_workers=workers)
            ranks.append([(b["index"], b["valid"]) for b in loader])
        assert_exactly_once(ranks, 1001, 8 * world, "pad")
        emulated = run_ranks(1001, world, 0, 8, "pad", seed=4, epoch=2, unit_size=8)
        assert all(
            torch.equal(a[0], b[0]) for r1, r2 in zip(ranks, emulated, strict=True) for a, b in zip(r1, r2, strict=True)
        )


def test_batches_carry_the_right_rows():
    ds = ShardedIterableDataset(source(50), 10, rank=1, world_size=2, seed=3)
    for batch in ds:
        assert torch.equal(batch["x"], batch["index"] * 10) and torch.equal(batch["y"], batch["index"] % 7)


# ------------------------------------------------------------------------------- parquet, read amplification


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    n = 1000
    write_shards(
        {"x": torch.arange(n), "img": torch.arange(n * 4, dtype=torch.int32).reshape(n, 2, 2)},
        str(folder),
        "train",
        num_shards=5,
        rows_per_group=8,
    )
    return str(folder)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_only_its_share_of_rows(parquet_dir, world):
    rows, bytes_read = [], []
    seen = []
    for r in range(world):
        src = ParquetSource(shards_in(parquet_dir, "train"))
        ds = ShardedIterableDataset(src, 16 * world, r, world, seed=1, policy="pad")
        for batch in ds:
            assert torch.equal(batch["x"], batch["index"])
            assert torch.equal(batch["img"].view(torch.int32).view(-1, 4)[:, 0], batch["index"] * 4)
            seen += batch["index"][batch["valid"]].tolist()
        rows.append(src.rows_read)
        bytes_read.append(src.bytes_read)
    assert sorted(seen) == list(range(1000))
    # 1000 rows / (16 * W) per global batch: padding rounds the share up by at most one global batch
    assert all(r <= 1000 / world + 16 for r in rows), rows
    assert sum(rows) <= 1000 + 16 * world
    assert max(bytes_read) <= 1.1 * sum(bytes_read) / world


def test_uneven_shards_and_a_misaligned_batch_still_cover_exactly_once(tmp_path):
    paths = []
    start = 0
    for i, n in enumerate([37, 5, 100]):  # shards of very different sizes, short row groups
        paths += write_shards(
            {"x": torch.arange(start, start + n)},
            str(tmp_path),
            f"part{i}",
            1,
            rows_per_group=8,
        )
        start += n
    ranks = []
    for r in range(3):
        ds = ShardedIterableDataset(ParquetSource(paths), 15, r, 3, seed=2, policy="pad")
        ranks.append([(b["x"], b["valid"]) for b in ds])
    assert len({len(r) for r in ranks}) == 1
    assert sorted(valid_ids(ranks)) == list(range(142))


# ------------------------------------------------------------------------------- errors


def test_global_batch_not_divisible_by_world_size():
    with pytest.raises(PlanError, match="not divisible by world size 3"):
        BatchPlan([1] * 10, 8, world_size=3)


def test_too_few_samples_for_drop():
    with pytest.raises(PlanError, match="fewer than one global batch"):
        BatchPlan([1] * 5, 8, policy="drop")


def test_mismatched_seed_across_ranks():
    a = ShardedIterableDataset(source(10), 2, 0, 2, seed=1).identity()
    b = ShardedIterableDataset(source(10), 2, 1, 2, seed=2).identity()
    with pytest.raises(PlanError, match="seed differ"):
        check_same_plan(a, lambda objs: [a, b])
    check_same_plan(a, lambda objs: [a, dict(a)])  # equal plans pass


def test_state_from_another_dataset_is_refused():
    state = ShardedIterableDataset(source(100), 4, seed=1).state_dict(next_batch=3)
    other = TensorSource({"x": torch.arange(100) + 1, "y": torch.arange(100) % 7})
    with pytest.raises(PlanError, match="fingerprint"):
        ShardedIterableDataset(other, 4, seed=1).load_state_dict(state)
    with pytest.raises(PlanError, match="seed"):
        ShardedIterableDataset(source(100), 4, seed=2).load_state_dict(state)


# ------------------------------------------------------------------------------- negative controls


class SeedFilter(IterableDataset):
    """The seed notes' hand-written sharding: one counter, `count % W == rank and count % K == worker`."""

    def __init__(self, n, rank, world, batch):
        self.n, self.rank, self.world, self.batch = n, rank, world, batch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        ids = [i for i in range(self.n) if i % self.world == self.rank and i % workers == worker]
        for s in range(0, len(ids), self.batch):
            chunk = torch.tensor(ids[s : s + self.batch])
            yield {"index": chunk, "valid": torch.ones(len(chunk), dtype=torch.bool)}


class SeedVariant(SeedFilter):
    """The variant `i % (W*K) == rank + worker`, which duplicates and loses samples."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        ids = [i for i in range(self.n) if i % (self.world * workers) == self.rank + worker]
        for s in range(0, len(ids), self.batch):
            chunk = torch.tensor(ids[s : s + self.batch])
            yield {"index": chunk, "valid": torch.ones(len(chunk), dtype=torch.bool)}


def test_negative_control_seed_filter_leaves_workers_idle_and_counts_uneven():
    per_worker, _ = worker_outputs(SeedFilter(1000, rank=0, world=2, batch=10), 2)
    assert min(len(w) for w in per_worker) == 0, "the checks below would not catch the seed's filter"
    ranks = [worker_outputs(SeedFilter(1001, r, 2, 10), 2)[1] for r in range(2)]
    assert sum(len(b["index"]) for b in ranks[0]) != sum(len(b["index"]) for b in ranks[1])


def test_negative_control_seed_variant_fails_coverage():
    ranks = [[(b["index"], b["valid"]) for b in worker_outputs(SeedVariant(1000, r, 2, 10), 2)[1]] for r in range(2)]
    with pytest.raises(AssertionError):
        assert_exactly_once(ranks, 1000, 20, "pad")


def test_negative_control_double_sharding_by_prepare_fails_coverage():
    # What accelerate.prepare(dispatch_batches=False) does to an IterableDataset: IterableDatasetShard.
    from accelerate.data_loader import IterableDatasetShard

    ranks = []
    for r in range(2):
        ours = ShardedIterableDataset(source(96), 16, r, 2, seed=0)
        rows = (i for b in ours for i in b["index"].tolist())
        resharded = IterableDatasetShard(list(rows), batch_size=8, num_processes=2, process_index=r)
        ids = torch.tensor(list(resharded))
        ranks.append([(ids, torch.ones(len(ids), dtype=torch.bool))])
    with pytest.raises(AssertionError, match="samples seen"):
        assert_exactly_once(ranks, 96, 16, "drop")
    assert len(valid_ids(ranks)) == 48  # half of the data silently lost


# ------------------------------------------------------------------------------- empty shards


# shards of 3 to 4 row groups of 16 with short tails beside tiny ones (500 and 480 rows read 10x longer)
@pytest.mark.parametrize(
    "sizes",
    [[3, 0, 50, 17, 1, 48], [0, 3, 50, 17, 1, 48], [3, 50, 17, 1, 48, 0], [0, 0, 40, 0, 7, 0]],
    ids=["middle", "start", "end", "many"],
)
def test_empty_shards_anywhere_keep_exactly_once(tmp_path, sizes):
    """A 0-row shard (a filter's leftover, a tiny tail file) once gave a phantom sample: one row
    delivered twice per epoch and another never."""
    paths, start = [], 0
    for i, n in enumerate(sizes):
        paths += write_shards(
            {"x": torch.arange(start, start + n), "img": torch.zeros(n, 3, dtype=torch.uint8)},
            str(tmp_path),
            f"part{i}",
            1,
            rows_per_group=16,
        )
        start += n
    total = sum(sizes)
    assert ParquetSource(paths).num_rows == total
    for world, workers, policy in itertools.product(range(1, 7), range(0, 4), ["drop", "pad"]):
        per_rank = 5
        ranks = []
        for r in range(world):
            ds = ShardedIterableDataset(ParquetSource(paths), per_rank * world, r, world, seed=3, policy=policy)
            ds.set_epoch(1)
            _, merged = worker_outputs(ds, workers)
            assert all(torch.equal(b["x"], b["index"]) for b in merged)  # the rows are the ones planned
            ranks.append([(b["index"], b["valid"]) for b in merged])
        assert len({len(r) for r in ranks}) == 1
        assert_exactly_once(ranks, total, per_rank * world, policy)


def test_epoch_order_of_units_with_empty_ones_is_a_permutation():
    from data.sharding import epoch_order

    for sizes in ([0], [0, 0], [2, 0, 2], [0, 1, 0, 1], [4, 0, 4, 3, 0]):
        for epoch in range(3):
            assert sorted(epoch_order(sizes, 0, epoch).tolist()) == list(range(sum(sizes)))


def test_all_shards_empty_is_refused_in_one_line(tmp_path):
    paths = write_shards({"x": torch.arange(0)}, str(tmp_path), "train", 2)
    with pytest.raises(PlanError, match="hold no rows"):
        ParquetSource(paths)


def test_string_column_names_itself_and_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "bc", None], "y": [1, 2, 3]}), str(tmp_path / "t.parquet"))
    ds = ShardedIterableDataset(ParquetSource([str(tmp_path / "t.parquet")]), 3, policy="pad")
    with pytest.raises(PlanError, match="column 'text' .*string.*decode"):
        list(ds)


def test_a_loader_without_workers_hands_out_what_a_dataloader_would():
    # without workers ShardedLoader reads the dataset itself, not through a DataLoader: the batches must
    # be the same, numpy arrays from a source or transform made tensors as torch's default_convert does
    from data.loader import ShardedLoader

    class NumpySource(TensorSource):
        def read(self, ids):
            return {"x": self.tensors["x"][ids].numpy(), "words": [f"w{i}" for i in ids.tolist()]}

    def batches(read):
        return read(ShardedIterableDataset(NumpySource({"x": torch.arange(20) * 3}, unit_size=4), 4, seed=5))

    ours = batches(lambda ds: list(ShardedLoader(ds)))
    theirs = batches(lambda ds: list(DataLoader(ds, batch_size=None)))
    assert len(ours) == len(theirs) == 5
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.keys() == other.keys() and isinstance(mine["x"], torch.Tensor)
        assert all(torch.equal(mine[k], other[k]) if k != "words" else mine[k] == other[k] for k in mine)


# ------------------------------------------------------------------------------- Hugging Face datasets


def hf_dataset(n):
    import datasets

    return datasets.Dataset.from_dict({"x": list(range(n)), "text": [f"row {i}" for i in range(n)]})


def hf_ranks(data, world, workers, per_rank, policy, epoch=0, start=0, seed=5):
    ranks = []
    for r in range(world):
        ds = ShardedIterableDataset(data, per_rank * world, r, world, seed=seed, policy=policy)
        ds.set_epoch(epoch, start)
        _, merged = worker_outputs(ds, workers)
        for b in merged:  # the rows read are the rows planned, strings included
            assert torch.equal(b["x"], b["index"]) and b["text"] == [f"row {i}" for i in b["index"].tolist()]
        ranks.append([(b["index"], b["valid"]) for b in merged])
    return ranks


@pytest.mark.parametrize("n", [7, 1001])
@pytest.mark.parametrize("world", range(1, 7))
def test_a_datasets_dataset_is_a_source_exactly_once_for_any_world_and_workers(n, world):
    data = hf_dataset(n)
    for workers, policy in itertools.product(range(0, 4), ["drop", "pad"]):
        if policy == "drop" and n < 3 * world:
            continue
        ranks = hf_ranks(data, world, workers, 3, policy)
        assert len({len(r) for r in ranks}) == 1
        assert_exactly_once(ranks, n, 3 * world, policy)


def test_a_datasets_dataset_resumes_exactly_with_another_world_size():
    data = hf_dataset(100)
    whole = global_batches(hf_ranks(data, 2, 0, 5, "pad", epoch=3))
    state = ShardedIterableDataset(data, 10, 0, 2, seed=5, policy="pad").state_dict(4)
    resumed = ShardedIterableDataset(data, 10, 0, 5, seed=5, policy="pad")
    resumed.load_state_dict({**state, "epoch": 3})
    rest = global_batches(hf_ranks(data, 5, 0, 2, "pad", epoch=3, start=resumed.start_batch))
    assert [b.tolist() for b in rest] == [b.tolist() for b in whole[4:]]


@pytest.mark.parametrize("kind", ["csv", "json", "text", "parquet", "arrow_on_disk"])
def test_local_files_through_datasets_are_sharded_exactly_once(tmp_path, kind):
    import datasets

    n = 103
    if kind == "csv":
        (tmp_path / "d.csv").write_text("x,text\n" + "".join(f"{i},row {i}\n" for i in range(n)))
    elif kind == "json":
        (tmp_path / "d.json").write_text("".join(f'{{"x": {i}, "text": "row {i}"}}\n' for i in range(n)))
    elif kind == "text":
        (tmp_path / "d.text").write_text("".join(f"row {i}\n" for i in range(n)))
    if kind == "arrow_on_disk":
        hf_dataset(n).save_to_disk(str(tmp_path / "saved"))
        data = datasets.load_from_disk(str(tmp_path / "saved"))  # memory-mapped, not in memory
    elif kind == "parquet":
        hf_dataset(n).to_parquet(str(tmp_path / "d.parquet"))
        data = datasets.load_dataset(
            "parquet", data_files=str(tmp_path / "d.parquet"), split="train", cache_dir=str(tmp_path / "cache")
        )
    else:
        data = datasets.load_dataset(
            kind, data_files=str(next(tmp_path.glob("d.*"))), split="train", cache_dir=str(tmp_path / "cache")
        )
    if kind == "text":  # one column, "text": the row number is in it
        data = data.map(lambda row: {"x": int(row["text"].split()[1])}, cache_file_name=str(tmp_path / "m.arrow"))
    for world, workers in ((1, 0), (3, 2)):
        ranks = hf_ranks(data, world, workers, 4, "pad")
        assert_exactly_once(ranks, n, 4 * world, "pad")


@pytest.mark.parametrize("world", range(1, 7))
def test_a_streaming_datasets_iterable_over_parquet_is_sharded_by_row_group(tmp_path, world):
    """load_dataset("parquet", streaming=True) over shards of uneven sizes (an empty one among them):
    every row once per epoch for any W and K, strings included, and each rank reads only its row groups."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    sizes, start, files = [40, 0, 96, 24, 8], 0, []
    for i, size in enumerate(sizes):
        rows = range(start, start + size)
        files.append(str(tmp_path / f"p{i}.parquet"))
        pq.write_table(
            pa.table({"x": pa.array(rows, pa.int64()), "text": pa.array([f"row {j}" for j in rows])}),
            files[-1],
            row_group_size=4,
        )
        start += size
    stream = datasets.load_dataset(
        "parquet", data_files=files, split="train", streaming=True, cache_dir=str(tmp_path / "cache")
    )
    for workers, policy in itertools.product(range(0, 4), ["drop", "pad"]):
        ranks = hf_ranks(stream, world, workers, 4, policy)
        assert len({len(r) for r in ranks}) == 1
        assert_exactly_once(ranks, start, 4 * world, policy)
    readers = [ShardedIterableDataset(stream, 4 * world, r, world, seed=1, policy="drop") for r in range(world)]
    for ds in readers:
        list(ds)
    planned = start - start % (4 * world)
    # a row group of 4 belongs to one rank: each reads exactly its 1/W of the rows, no row group twice
    assert [ds.source.rows_read for ds in readers] == [planned // world] * world
    read = [ds.source.bytes_read for ds in readers]
    assert max(read) <= 1.05 * sum(read) / world  # bytes too, up to the row groups' own sizes


def test_a_streaming_iterable_that_is_not_plain_parquet_is_refused_with_what_to_pass(tmp_path):
    import datasets

    hf_dataset(10).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.csv").write_text("x\n1\n2\n")
    stream = datasets.load_dataset("parquet", data_files=str(tmp_path / "d.parquet"), split="train", streaming=True)
    mapped = stream.map(lambda row: {"y": row["x"]})
    csv = datasets.load_dataset("csv", data_files=str(tmp_path / "d.csv"), split="train", streaming=True)
    for refused in (mapped, csv, hf_dataset(10).to_iterable_dataset()):
        with pytest.raises(PlanError, match="not plain local parquet files.*ParquetSource"):
            ShardedIterableDataset(refused, 4)
    with pytest.raises(PlanError, match="is not a source"):
        ShardedIterableDataset([1, 2, 3], 4)


# ------------------------------------------------------------------------------- prepare() on sharded data


@pytest.mark.parametrize("workers", [0, 2])
def test_reading_through_accelerates_rank_splitting_is_refused(workers):
    """What accelerator.prepare makes of a DataLoader over our dataset, built by hand in one process:
    the first batch raises instead of yielding a share of a share (or rank 0's share to everyone).
    prepare wraps IterableDatasetShard in a DataLoaderShard, which registers with accelerate's
    GradientState: that is what the dataset sees in the main process. A bare torch DataLoader over
    IterableDatasetShard (which prepare never builds) is seen only in a worker, through WorkerInfo."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, IterableDatasetShard

    ours = ShardedIterableDataset(source(64), 16, rank=0, world_size=2)
    assert len(list(DataLoader(ours, batch_size=None, num_workers=workers))) == 4  # unwrapped: fine
    wrapped = IterableDatasetShard(ours, batch_size=1, num_processes=2, process_index=0)
    with pytest.raises(PlanError, match="went through accelerator.prepare"):
        next(iter(DataLoaderShard(wrapped, batch_size=None, num_workers=workers)))
    if workers:
        with pytest.raises(PlanError, match="went through accelerator.prepare"):
            next(iter(DataLoader(wrapped, batch_size=None, num_workers=workers)))
    if workers == 0:  # the dispatcher reads in the main process
        with pytest.raises(PlanError, match="went through accelerator.prepare"):
            next(iter(DataLoaderDispatcher(ours, batch_size=None)))
    alone = ShardedIterableDataset(source(64), 16, rank=0, world_size=1)  # one rank: nothing to lose
    assert len(list(IterableDatasetShard(alone, batch_size=1, num_processes=1, process_index=0))) == 4


def test_a_datasets_dataset_gives_bytes_whole_and_fixed_length_lists_as_tensors():
    """datasets' own "torch" format turns b"ab\x00\x00" into b"ab"; image bytes end in zeros."""
    import datasets

    data = datasets.Dataset.from_dict(
        {
            "b": [b"ab\x00\x00", b"\x00\x00cd", b""],
            "v": [[1.5, 2.0], [3.0, 4.0], [0.0, 1.0]],
            "ragged": [[1], [2, 3], []],
            "y": [0, 1, 2],
        }
    )
    batch = DatasetsSource(data).read(torch.tensor([2, 0, 1]))
    assert batch["b"] == [b"", b"ab\x00\x00", b"\x00\x00cd"]
    assert torch.equal(batch["v"], torch.tensor([[0.0, 1.0], [1.5, 2.0], [3.0, 4.0]], dtype=torch.float64))
    assert batch["ragged"] == [[], [1], [2, 3]] and batch["y"].tolist() == [2, 0, 1]
