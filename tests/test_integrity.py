"""Integrity a bit flip cannot pass: every chunk of a new store ends with its crc32c, the completion marker records
the sha256 of every ``zarr.json``, ``foveate verify --deep`` reads every chunk, and old stores (no checksums, no
digests) still open. Real stores on disk, written by the tiler from synthetic slides."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.ingest_inputs import discover_inputs
from workers.chunks import ChunkChecksumError, local_chunk_reader
from workers.store import COMPLETE_MARKER, SlideStore, integrity_checks, verify_store
from workers.tiler import IngestOptions, Tiler


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    from pipeline.synthetic import write_synthetic_slide

    d = tmp_path_factory.mktemp("slides")
    svs = d / "int_a.svs"
    write_synthetic_slide(svs, width=2048, height=2048, label=1, seed=3, fmt="svs", tile_size=256)
    return {"svs": svs}


def _ingest(out, path, **kw) -> SlideStore:
    (inp,) = discover_inputs([path])
    tiler = Tiler(out, IngestOptions(**kw))
    tiler.ingest_slide(inp)
    tiler.close()
    return SlideStore(out / f"{inp.slide_id}.zarr")


def _flip_inside_chunk(store: SlideStore, level: int, cy: int, cx: int) -> None:
    """Flip one bit in the middle of the stored bytes of chunk (cy, cx) of ``level`` (inside its shard, if any)."""
    reader = local_chunk_reader(store.levels[level])
    assert reader is not None
    th, tw = reader.chunk
    if reader.shard is None:
        path = store.path / str(level) / "c" / "0" / str(cy) / str(cx)
        offset = path.stat().st_size // 2
    else:
        ny, nx = reader.shard[0] // th, reader.shard[1] // tw
        sy, sx = cy // ny, cx // nx
        path = store.path / str(level) / "c" / "0" / str(sy) / str(sx)
        index = reader._shard_index(str(path), (sy, sx), (ny, nx))
        off, n = (int(v) for v in index[cy - sy * ny, cx - sx * nx])
        offset = off + n // 2
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "kw",
    [{"codec": "zstd"}, {"codec": "zstd", "shard": False}, {"codec": "jpeg"}],
    ids=["zstd-sharded", "zstd-unsharded", "jpeg-passthrough"],
)
def test_every_array_of_a_new_store_ends_its_codec_chain_with_crc32c(tmp_path, slides, kw):
    store = _ingest(tmp_path / "stores", slides["svs"], tile_size=256, min_size=512, **kw)
    arrays = [f"{lv}" for lv in range(store.level_count)]
    arrays += [f"labels/tissue/{lv}" for lv in range(store.level_count)]
    for name in arrays:
        codecs = json.loads((store.path / name / "zarr.json").read_text())["codecs"]
        if codecs[0]["name"] == "sharding_indexed":
            assert [c["name"] for c in codecs[0]["configuration"]["index_codecs"]][-1] == "crc32c"
            codecs = codecs[0]["configuration"]["codecs"]
        assert codecs[-1]["name"] == "crc32c", (name, codecs)
    assert integrity_checks(store.path) == {"inventory": True, "metadata": True, "checksums": True}
    assert verify_store(store.path, deep=True) == []
    if kw["codec"] == "jpeg":
        assert store.meta.codec == "jpeg-passthrough"


@pytest.mark.parametrize("kw", [{"codec": "zstd"}, {"codec": "jpeg", "shard": False}], ids=["zstd-sharded", "jpeg"])
def test_a_flipped_bit_fails_the_read_naming_store_array_and_chunk(tmp_path, slides, kw, capsys):
    out = tmp_path / "stores"
    store = _ingest(out, slides["svs"], tile_size=256, min_size=512, **kw)
    region = store.read_region((0, 0), 0, (1024, 1024))  # whole before
    _flip_inside_chunk(store, 0, 2, 3)

    # shallow checks do not read chunks: the store still opens
    store = SlideStore(store.path)
    with pytest.raises(
        ChunkChecksumError, match=r"int_a-\w+\.zarr: array 0, chunk 0/2/3: stored crc32c does not match"
    ):
        store.read_region((0, 0), 0, (1024, 1024))
    np.testing.assert_array_equal(store.read_region((0, 0), 0, (512, 512)), region[:512, :512])  # others read
    # the patch reader's direct path (chunk files read without zarr) checks the same crc32c
    with pytest.raises(ChunkChecksumError, match=r"int_a-\w+\.zarr: array 0, chunk 0/2/3"):
        local_chunk_reader(store.levels[0]).read(2, 3)

    problems = verify_store(store.path, deep=True)
    assert len(problems) == 1 and "array 0, chunk 0/2/3" in problems[0], problems
    assert main(["verify", str(out)]) == 0  # without --deep: marker, metadata and inventory only
    capsys.readouterr()
    assert main(["verify", "--deep", str(out)]) == 1
    text = capsys.readouterr().out
    assert "int_a-" in text and ": damaged" in text and "chunk 0/2/3" in text


def test_a_rewritten_shape_is_damaged_and_ingested_again(tmp_path, slides):
    from pipeline.ingest import _complete

    out = tmp_path / "stores"
    store = _ingest(out, slides["svs"], tile_size=256, min_size=512)
    meta_path = store.path / "0" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = [3, meta["shape"][1], meta["shape"][2] + 512]  # valid JSON, a wider level 0
    meta_path.write_text(json.dumps(meta, indent=2))

    problems = verify_store(store.path)
    assert problems == ["0/zarr.json changed after ingest (its sha256 differs from the completion marker's)"]
    with pytest.raises(ValueError, match=r"damaged: 0/zarr.json changed after ingest"):
        SlideStore(store.path)
    assert _complete(str(store.path)) is False  # re-ingest does not skip it as complete
    assert main(["verify", str(out)]) == 1


def test_a_removed_label_metadata_is_damaged(tmp_path, slides):
    store = _ingest(tmp_path / "stores", slides["svs"], tile_size=256, min_size=512)
    (store.path / "labels" / "tissue" / "1" / "zarr.json").unlink()
    assert "labels/tissue/1/zarr.json is missing (the completion marker records its digest)" in verify_store(store.path)


def test_an_old_store_without_checksums_or_digests_still_opens(tmp_path, slides, capsys):
    out = tmp_path / "stores"
    store = _ingest(out, slides["svs"], tile_size=256, min_size=512, checksum=False, codec="zstd")
    marker = store.path / COMPLETE_MARKER
    body = json.loads(marker.read_text())
    del body["metadata"]  # a marker written before the digests existed
    marker.write_text(json.dumps(body))
    codecs = json.loads((store.path / "0" / "zarr.json").read_text())["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in codecs] == ["transpose", "bytes", "zstd"]

    old = SlideStore(store.path)
    assert old.read_region((0, 0), 0, (300, 300)).shape == (300, 300, 3)
    assert integrity_checks(store.path) == {"inventory": True, "metadata": False, "checksums": False}
    assert verify_store(store.path, deep=True) == []
    assert local_chunk_reader(old.levels[0]) is not None
    assert main(["verify", "--deep", str(out)]) == 0
    text = capsys.readouterr().out
    assert ": ok (" in text and "no metadata digests" in text and "no chunk checksums" in text


def test_a_resumed_store_of_an_older_plan_is_written_afresh(tmp_path, slides):
    """A half-written store planned before checksums existed is not resumed by a tiler that writes them (its
    arrays' codec chains would not match the chunks): the plan differs, so the store starts again."""
    from workers.tiler import PLAN_FILE

    out = tmp_path / "stores"
    (inp,) = discover_inputs([slides["svs"]])
    tiler = Tiler(out, IngestOptions(tile_size=256, min_size=512))
    plan = tiler.plan(inp)
    tiler.write_region(plan.store_path, plan.todo[0][0])
    tiler.close()
    plan_file = out / f"{inp.slide_id}.zarr" / PLAN_FILE
    old = json.loads(plan_file.read_text())
    del old["options"]["checksum"]  # as an older version wrote it
    plan_file.write_text(json.dumps(old))
    tiler = Tiler(out, IngestOptions(tile_size=256, min_size=512))
    assert tiler.plan(inp).resumed_regions == 0
    tiler.close()
