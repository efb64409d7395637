"""prepare_data.py on a real little corpus (text, JSONL, gzip, unicode, empty documents) and a BPE tokenizer
built here: exact token and EOS counts, byte-identical output whatever --workers, training on a partitioned
result, the validation split the same however the corpus is cut, uint32 shards for a big vocabulary, upload
then download byte for byte, a run killed after some partitions finished by a rerun doing only the rest,
bad input. tests/unit/data/test_prepare_partitions.py has the plan, the merge, the bucket output and Ray."""
from __future__ import annotations

import gzip
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.trainkit import REPO_ROOT, run, train_cmd, train_rows
from utils.data.dataset_info import DatasetInfo
from utils.data.index import ShardIndex
from utils.io import files

WORDS = ("the quick brown fox jumps over the lazy dog; café naïve façade 日本語 ünïcödé 🙂 tokens model data "
         "train shard loader engine").split()
PREPARE = [sys.executable, str(REPO_ROOT / "prepare_data.py")]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(folder, documents in the order prepare_data reads them, empty count)."""
    root = tmp_path_factory.mktemp("corpus") / "corpus"
    (root / "sub").mkdir(parents=True)
    rng = random.Random(0)
    docs, empty = {}, 0
    for i in range(3):
        docs[f"a{i}.txt"] = [text(rng, 300 + 40 * i)]
        (root / f"a{i}.txt").write_text(docs[f"a{i}.txt"][0])
    (root / "blank.txt").write_text("  \n\t")
    empty += 1
    lines, kept = [], []
    for i in range(60):
        t = "" if i % 9 == 0 else text(rng, 20 + i % 13)
        lines.append(json.dumps({"id": i, "text": t}, ensure_ascii=i % 2 == 0))
        empty += t == ""
        kept += [t] if t else []
    (root / "sub" / "b.jsonl").write_text("\n".join(lines) + "\n\n")  # a trailing blank line is no document
    docs["sub/b.jsonl"] = kept
    gz = [text(rng, 15 + i % 7) for i in range(40)]
    with gzip.open(root / "sub" / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in gz)
    docs["sub/c.jsonl.gz"] = gz
    order = ["a0.txt", "a1.txt", "a2.txt", "sub/b.jsonl", "sub/c.jsonl.gz"]  # sorted paths (blank.txt: empty)
    return root, [d for name in order for d in docs[name]], empty


def bpe_tokenizer(path: Path, vocab: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    tok.train_from_iterator([text(rng, 40) for _ in range(300)], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def prepare(args: list, env: dict, check: bool = True):
    return run(PREPARE + [str(a) for a in args] + ["--no-progress"], env, check=check)


def all_ids(out: Path) -> np.ndarray:
    info = DatasetInfo.load(out)
    return np.concatenate([np.load(out / s["path"])["input_ids"] for s in info.shards])


def test_counts_order_and_byte_identical_whatever_the_workers(corpus, tokenizer, tmp_path, subprocess_env):
    from tokenizers import Tokenizer

    root, docs, empty = corpus
    outs = {}
    for workers in (1, 2):
        outs[workers] = tmp_path / f"w{workers}"
        proc = prepare(["--input", root, "--tokenizer", tokenizer, "--output", outs[workers], "--workers", workers,
                        "--shard-tokens", 1024, "--val-fraction", 0, "--partition-mb", 0.004], subprocess_env)
        assert re.search(r"[\d,]+ tokens/s", proc.stdout)
        assert re.search(r"^plan: 4 partition\(s\) of about 0.004 MB from 6 input file\(s\).*; 0 of 4 partitions "
                         r"already done$", proc.stdout, re.M), proc.stdout
    assert tree(outs[1]) == tree(outs[2])  # byte for byte, dataset.json included

    tok = Tokenizer.from_file(str(tokenizer))
    lengths = [len(tok.encode(d, add_special_tokens=False).ids) for d in docs]
    info = DatasetInfo.load(outs[1])
    ids = all_ids(outs[1])
    assert info.tokens == ids.size == sum(n + 1 for n in lengths)  # every document + its EOS
    assert info.documents == len(docs) and info.raw["documents_empty"] == empty
    assert int((ids == info.eos_id).sum()) == len(docs) and info.dtype == "uint16" and ids.dtype == np.uint16
    expected = np.concatenate([np.append(tok.encode(d, add_special_tokens=False).ids, info.eos_id) for d in docs])
    assert np.array_equal(ids, expected)  # in input order
    assert (info.raw["partitions"] == 4
            and [s["partition"] for s in info.shards] == sorted(s["partition"] for s in info.shards))
    for partition in range(4):  # each partition's stream: full shards, then a last one that is no sliver
        sizes = [s["tokens"] for s in info.shards if s["partition"] == partition]
        assert all(n == 1024 for n in sizes[:-1]) and (512 <= sizes[-1] < 1536 or len(sizes) == 1), sizes
    assert {p.name for p in outs[1].rglob("*") if p.is_file() and p.suffix != ".npz"} == \
        {"tokenizer.json", "dataset.json", "plan.json"}
    assert not (tmp_path / ".w1.staging").exists()  # the staging area goes once the dataset is published
    from utils.io.storage import file_crc32c

    assert all(file_crc32c(outs[1] / s["path"]) == s["crc32c"] for s in info.shards)
    ShardIndex.build(outs[1], seq_len=64, vocab_size=info.vocab_size, log=lambda *_: None)
    again = prepare(["--input", root, "--tokenizer", tokenizer, "--output", outs[1], "--shard-tokens", 1024,
                     "--val-fraction", 0, "--partition-mb", 0.004], subprocess_env)
    assert "already holds this dataset" in again.stdout


def tree(folder: Path) -> dict:
    """Every file under `folder` (hidden ones aside), by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.slow
def test_training_on_prepared_data_learns(corpus, tokenizer, tmp_path, subprocess_env):
    """A dataset cut into partitions (so several partitions' shorter last shards) trains and learns."""
    root, _, _ = corpus
    data = tmp_path / "data"
    prepare(["--input", root, "--tokenizer", tokenizer, "--output", data, "--shard-tokens", 2048,
             "--partition-mb", 0.004], subprocess_env)
    assert DatasetInfo.load(data).raw["partitions"] == 4
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "max_steps=30", "per_device_train_batch_size=4", "seq_len=32",
                         "learning_rate=3e-3", "logging_steps=5", "val_files=1", "save_steps=100"), subprocess_env)
    assert "vocabulary from" in proc.stdout  # the tokenizer's 400-odd ids, not tiny's 512
    rows = train_rows(out)
    assert rows[30]["loss"] < rows[5]["loss"] - 0.5, (rows[5]["loss"], rows[30]["loss"])
    assert "validation on the 1 shard(s) of dataset.json's split" in proc.stdout  # val_files=1 does not apply
    from tokenizers import Tokenizer

    exported = Tokenizer.from_file(str(out / "final_model" / "tokenizer.json"))
    assert exported.get_vocab() == Tokenizer.from_file(str(tokenizer)).get_vocab()


def test_validation_is_a_random_share_of_documents_from_the_whole_corpus(tokenizer, tmp_path):
    """Two kinds of documents, all of one kind first: validation holds both kinds, its documents are
    disjoint from training's, together they are the corpus, and the split is in dataset.json. The corpus
    cut into many partitions holds out the very same documents."""
    from tokenizers import Tokenizer

    from utils.data.partition import MIN_VAL_DOCUMENTS
    from utils.data.prepare import PrepareOptions
    from utils.data.prepare import prepare as prepare_in_process

    rng = random.Random(3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = {kind: [f"{kind} {i} " + text(rng, 12) for i in range(300)] for kind in ("alpha", "omega")}
    for kind, texts in docs.items():  # sorted order: every alpha document before every omega one
        (corpus / f"{kind}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = prepare_in_process([str(corpus)], str(tokenizer), tmp_path / "out",
                                PrepareOptions(shard_tokens=1024, val_fraction=0.01))
    info = DatasetInfo.load(tmp_path / "out")
    tok = Tokenizer.from_file(str(tokenizer))

    def documents(shards, root=tmp_path / "out"):
        ids = np.concatenate([np.load(root / s["path"])["input_ids"] for s in shards]).astype(np.int64)
        cuts = np.flatnonzero(ids == info.eos_id)
        return [tok.decode(part.tolist()) for part in np.split(ids, cuts + 1)[:-1]]

    val = documents(info.raw["validation"]["shards"])
    train = documents(info.shards)
    everything = docs["alpha"] + docs["omega"]
    assert len(val) == info.raw["validation"]["documents"] == result.val_documents >= MIN_VAL_DOCUMENTS // 2
    assert len(val) <= len(everything) // 4  # at most a quarter, raised from 1% for a small corpus
    assert info.raw["validation"]["rate"] == MIN_VAL_DOCUMENTS / len(everything) and result.partitions == 1
    assert not set(val) & set(train) and sorted(val + train) == sorted(everything)
    assert {d.split()[0] for d in val} == {"alpha", "omega"}  # drawn from the whole corpus, not its tail
    assert (all(p.startswith("val/") for p in info.val_paths)
            and not any(s["path"].startswith("val/") for s in info.shards))
    # seeded: another seed draws other documents; the same seed the same bytes
    other = prepare_in_process([str(corpus)], str(tokenizer), tmp_path / "other",
                               PrepareOptions(shard_tokens=1024, val_fraction=0.01, split_seed=7))
    other_val = documents(DatasetInfo.load(tmp_path / "other").raw["validation"]["shards"], tmp_path / "other")
    assert other.val_documents and set(other_val) != set(val)
    assert (tmp_path / "other" / "val").is_dir() and \
        (tmp_path / "other" / info.val_paths[0]).read_bytes() != (tmp_path / "out" / info.val_paths[0]).read_bytes()
    # each partition decides alone: cut into many, the same documents are held out, in the same order
    cut = prepare_in_process([str(corpus)], str(tokenizer), tmp_path / "cut",
                             PrepareOptions(shard_tokens=1024, val_fraction=0.01, partition_bytes=3000))
    cut_info = DatasetInfo.load(tmp_path / "cut")
    assert cut.partitions >= 8 and documents(cut_info.raw["validation"]["shards"], tmp_path / "cut") == val
    assert [(tmp_path / "cut" / p).read_bytes() for p in cut_info.val_paths] == \
        [(tmp_path / "out" / p).read_bytes() for p in info.val_paths]
    assert documents(cut_info.shards, tmp_path / "cut") == train


def big_vocab_tokenizer(path: Path, size: int = 70_000) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0} | {w: i + 1 for i, w in enumerate(dict.fromkeys(WORDS))}
    vocab |= {f"w{i}": i for i in range(len(vocab), size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w69999"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_a_vocabulary_above_65536_gives_uint32_shards_that_validate_and_train(tmp_path, subprocess_env):
    corpus = tmp_path / "c"
    corpus.mkdir()
    rng = random.Random(2)
    (corpus / "d.jsonl").write_text("".join(json.dumps({"text": text(rng, 50) + " w69000 w65540"}) + "\n"
                                            for _ in range(80)))
    data = tmp_path / "data"
    prepare(["--input", corpus, "--tokenizer", big_vocab_tokenizer(tmp_path / "t.json"), "--output", data,
             "--shard-tokens", 2048], subprocess_env)
    info = DatasetInfo.load(data)
    ids = all_ids(data)
    assert info.dtype == "uint32" and ids.dtype == np.uint32 and info.vocab_size == 70_000 and ids.max() >= 69_000
    ShardIndex.build(data, seq_len=32, vocab_size=70_000, log=lambda *_: None)
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "max_steps=2", "per_device_train_batch_size=2", "seq_len=32", "val_files=1",
                         "save_steps=100"), subprocess_env)
    assert "vocabulary from" in proc.stdout and "70,016 embedding rows" in proc.stdout  # padded to 128s
    from safetensors.torch import load_file

    assert load_file(str(out / "final_model" / "model.safetensors"))["gpt_neox.embed_in.weight"].shape[0] == 70_016
    # an id beyond the tokenizer's vocabulary is refused, naming the file
    bad = data / "part-00000" / "shard-00000.npz"
    arr = np.load(bad)["input_ids"].copy()
    arr[5] = 70_001
    np.savez(bad, input_ids=arr)
    # ...listed in dataset.json with its own size and crc32c (a tokenizer's mistake, not a corrupt file)
    from utils.io.storage import file_crc32c

    described = json.loads((data / "dataset.json").read_text())
    for entry in described["shards"]:
        if entry["path"] == bad.relative_to(data).as_posix():
            entry.update(bytes=bad.stat().st_size, crc32c=file_crc32c(bad))
    (data / "dataset.json").write_text(json.dumps(described))
    proc = run(train_cmd(tmp_path / "o2", data, "max_steps=1", "seq_len=32", "val_files=1"), subprocess_env,
               check=False)
    assert proc.returncode == 2 and f"{bad.as_posix()}: holds id 70001 but vocab_size is 70000" in proc.stderr


def test_upload_then_download_reproduces_it_byte_for_byte(corpus, tokenizer, tmp_path, subprocess_env,
                                                          gcs_emulator):
    root, _, _ = corpus
    data = tmp_path / "data"
    subprocess_env["STORAGE_EMULATOR_HOST"] = gcs_emulator.url
    url = f"gs://{gcs_emulator.bucket}/datasets/mine"
    proc = prepare(["--input", root, "--tokenizer", tokenizer, "--output", data, "--shard-tokens", 1024,
                    "--upload", url], subprocess_env)
    assert "uploaded" in proc.stdout and url in proc.stdout
    mirror = tmp_path / "mirror"
    run([sys.executable, str(REPO_ROOT / "download_training_data.py"), "--source", url, "--dest", str(mirror),
         "--no-progress"], subprocess_env)

    def tree(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
                if p.is_file() and not p.name.startswith(".")}

    assert tree(mirror) == tree(data)


def test_a_run_killed_after_some_partitions_is_finished_by_a_rerun_doing_only_the_rest(tokenizer, tmp_path,
                                                                                     subprocess_env):
    """SIGKILL once the first partition's completion record is written: nothing looks like a dataset; the
    rerun counts the partitions done, tokenizes only the others, and writes what an uninterrupted run writes."""
    big = tmp_path / "big"
    big.mkdir()
    rng = random.Random(3)
    with open(big / "many.jsonl", "w") as f:
        for _ in range(6_000):
            f.write(json.dumps({"text": text(rng, 60)}) + "\n")
    args = ["--input", big, "--tokenizer", tokenizer, "--shard-tokens", 4096, "--workers", 1, "--partition-mb", 0.35]
    out = tmp_path / "out"
    proc = subprocess.Popen(PREPARE + [str(a) for a in args + ["--output", out, "--no-progress"]],
                            env=subprocess_env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def records():
        return sorted((tmp_path / ".out.staging").glob("p*/done.json"))

    deadline = time.time() + 120
    while not records():
        assert proc.poll() is None and time.time() < deadline, "never finished a partition"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # shards exist only inside the hidden staging folder
    with pytest.raises(Exception, match="does not exist"):
        ShardIndex.build(out, seq_len=32, vocab_size=400, log=lambda *_: None)
    done = len(records())
    plan = json.loads((tmp_path / ".out.staging" / "plan.json").read_text())
    total = len(plan["partitions"])
    assert total == 9 and 1 <= done < total, (done, total)
    rerun = prepare(args + ["--output", out], subprocess_env)
    assert f"; {done} of {total} partitions already done" in rerun.stdout
    assert f"{total} partition(s), {done} done by an earlier run" in rerun.stdout
    clean = tmp_path / "clean"
    prepare(args + ["--output", clean], subprocess_env)
    assert [p.name for p in tmp_path.iterdir() if files.is_temp_name(p.name) or p.name.endswith(".staging")] == []
    assert tree(out) == tree(clean)


def test_a_crafted_completion_record_naming_a_file_outside_is_refused(corpus, tokenizer, tmp_path, subprocess_env):
    """A staging folder whose done.json names ../../secret.txt (or an absolute path) for a shard: the rerun
    refuses it in one line naming the file and field, and moves nothing, where the merge moved that file into
    the published dataset."""
    args = ["--input", corpus[0], "--tokenizer", tokenizer]
    prepare(args + ["--output", tmp_path / "real"], subprocess_env)
    description = json.loads((tmp_path / "real" / "dataset.json").read_text())
    secret = tmp_path / "secret.txt"
    secret.write_text("not a shard, and not the dataset's\n")
    for i, named in enumerate(["../../secret.txt", str(secret)]):
        staging = tmp_path / f".crafted{i}.staging"
        (staging / "p00000").mkdir(parents=True)
        (staging / "plan.json").write_bytes((tmp_path / "real" / "plan.json").read_bytes())
        assert description["partitions"] == 1
        record = {"partition": 0, "plan": description["fingerprint"], "documents": description["documents"],
                  "documents_empty": description["documents_empty"], "tokens": description["tokens"],
                  "validation": {"documents": 0, "tokens": 0},
                  "shards": [{"path": named, "tokens": 10, "bytes": secret.stat().st_size,
                              "crc32c": ""}]}
        (staging / "p00000" / "done.json").write_text(json.dumps(record))
        proc = prepare(args + ["--output", tmp_path / f"crafted{i}"], subprocess_env, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert re.search(r"p00000/done\.json: shards\[0\]\.path .* is not a shard file", lines[0]), lines[0]
        assert secret.exists() and not (tmp_path / f"crafted{i}").exists()


def test_a_gs_output_is_locked_as_a_local_one_is(corpus, tokenizer, tmp_path, subprocess_env, gcs_emulator):
    """--output gs://... held by another prepare (its lock object beside the prefix, another host): refused in
    one line naming the holder and the lock, nothing written (the two published one after the other); a lock
    left by a dead process of this host is taken over, and the run's own lock is gone when it ends."""
    import os
    import socket

    from utils.io.storage import make_client

    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    bucket = make_client().bucket(gcs_emulator.bucket)
    lock = bucket.blob("sets/.ds.lock")
    lock.upload_from_string(json.dumps({"host": "trainer-7", "pid": 4242, "started_unix": 0}))
    args = ["--input", corpus[0], "--tokenizer", tokenizer, "--output", f"gs://{gcs_emulator.bucket}/sets/ds"]
    proc = prepare(args, env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is being prepared by another prepare_data.py (host trainer-7, pid 4242)" in lines[0]
    assert f"remove gs://{gcs_emulator.bucket}/sets/.ds.lock" in lines[0]
    assert [b.name for b in bucket.list_blobs(prefix="sets/")] == ["sets/.ds.lock"]

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.upload_from_string(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started_unix": 0}))
    prepare(args, env)
    names = [b.name for b in bucket.list_blobs(prefix="sets/")]
    assert "sets/ds/dataset.json" in names and "sets/.ds.lock" not in names, names
    assert os.getpid() != dead.pid


@pytest.mark.parametrize("case, fragment", [
    ("bad_json", r"b\.jsonl:2: not valid JSON"),
    ("no_field", r"b\.jsonl:1: no 'text' field; name the field with --text-field"),
    ("not_string", r"b\.jsonl:1: 'text' is a int, not a string"),
    ("not_utf8", r"a\.txt: not UTF-8 text"),
    ("empty", r"the corpus is empty"),
    ("no_eos", r"no end-of-document token found .* name one with --eos-token"),
    ("missing", r"--input .*nowhere: no such file or folder"),
    ("no_ray_cluster", r"--ray-address 127\.0\.0\.1:9: nothing answers there"),
])
def test_bad_input_is_one_line_naming_the_file(tmp_path, subprocess_env, tokenizer, case, fragment):
    corpus = tmp_path / "c"
    corpus.mkdir()
    tok = tokenizer
    inputs, extra = [corpus], []
    if case == "bad_json":
        (corpus / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    elif case == "no_field":
        (corpus / "b.jsonl").write_text('{"body": "x"}\n')
    elif case == "not_string":
        (corpus / "b.jsonl").write_text('{"text": 7}\n')
    elif case == "not_utf8":
        (corpus / "a.txt").write_bytes(b"caf\xe9 au lait")
    elif case == "empty":
        (corpus / "a.txt").write_text("\n\n")
        (corpus / "b.jsonl").write_text('{"text": ""}\n')
    elif case == "no_eos":
        (corpus / "a.txt").write_text("hello world")
        from tokenizers import Tokenizer, models, pre_tokenizers

        t = Tokenizer(models.WordLevel(vocab={"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = tmp_path / "noeos.json"
        t.save(str(tok))
    elif case == "missing":
        inputs = [tmp_path / "nowhere"]
    elif case == "no_ray_cluster":
        (corpus / "a.txt").write_text("hello world")
        extra = ["--executor", "ray", "--ray-address", "127.0.0.1:9"]
    out = tmp_path / "out"
    proc = prepare(["--input", *inputs, "--tokenizer", tok, "--output", out, "--workers", 1, *extra], subprocess_env,
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(fragment, lines[0]), proc.stderr
    assert not out.exists()



def test_a_long_document_is_tokenized_in_pieces_with_the_whole_documents_ids(tokenizer):
    """A document is cut before a space between two words, where a byte-level BPE cuts anyway: the pieces
    join to the text and their ids to the whole document's, for runs of spaces, newlines and punctuation too."""
    from tokenizers import Tokenizer

    from utils.data.partition import split_document

    rng = random.Random(3)
    words = ["alpha", "beta,", "gamma.", "  delta", "\n\nepsilon", "zeta\t", "(eta)", "théta", "1234", "--"]
    document = " ".join(rng.choice(words) for _ in range(60_000))
    tok = Tokenizer.from_file(str(tokenizer))
    for piece_chars in (1_000, 7_777, 100_000):
        pieces = split_document(document, piece_chars)
        assert "".join(pieces) == document and len(pieces) > len(document) // piece_chars - 1
        assert all(len(p) <= piece_chars for p in pieces)
        ids = [i for enc in tok.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
        assert ids == tok.encode(document, add_special_tokens=False).ids, piece_chars
    no_space = "x" * 2_500
    assert split_document(no_space, 1_000) == ["x" * 1_000, "x" * 1_000, "x" * 500]


@pytest.mark.slow
def test_a_12_mb_document_is_prepared_in_bounded_memory(tmp_path, subprocess_env, tokenizer):
    """One 12 MB JSONL document (3M+ tokens of this tokenizer): tokenized whole it took 3 GB; in pieces
    the prepare process stays under 1 GB, and every token is in the shards."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "b.jsonl").write_text(json.dumps({"text": "word and other words, " * (12_000_000 // 22)}) + "\n")
    out = tmp_path / "out"
    proc, peak_mb = _prepare_measured(corpus, tokenizer, out, subprocess_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert peak_mb < 1000, f"prepare peaked at {peak_mb:.0f} MB"
    assert DatasetInfo.load(out).tokens > 3_000_000


def _prepare_measured(corpus: Path, tokenizer: Path, out: Path, env: dict):
    """prepare_data.py run in a child, with the child's peak RSS in MB."""
    measure = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
               "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(p.returncode)")
    proc = subprocess.run([sys.executable, "-c", measure, *PREPARE, "--input", str(corpus), "--tokenizer",
                           str(tokenizer), "--output", str(out), "--workers", "1", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, int(re.search(r"maxrss_kb (\d+)", proc.stderr).group(1)) / 1024


@pytest.mark.parametrize("case", ["jsonl_line", "gzip_bomb"])
def test_a_document_over_the_bound_is_one_line_before_it_is_read_whole(tmp_path, subprocess_env, tokenizer, case):
    """A 70 MB JSONL line, or a 200 KB .txt.gz that expands to one 200 MB document: refused in one line
    naming the file (and line) before it is read whole; the process's memory stays small."""
    from utils.data.corpus import MAX_DOCUMENT_BYTES

    corpus = tmp_path / "c"
    corpus.mkdir()
    if case == "jsonl_line":
        with open(corpus / "b.jsonl", "w") as f:
            f.write('{"text": "a short first document"}\n')
            f.write('{"text": "' + "word " * (14 << 20) + '"}\n')
        where = r"b\.jsonl:2: a document over 64 MiB"
    else:
        with gzip.open(corpus / "a.txt.gz", "wb", compresslevel=1) as f:
            chunk = b"lorem ipsum " * (1 << 20)
            for _ in range(16):
                f.write(chunk)
        where = r"a\.txt\.gz: a document over 64 MiB"
    assert MAX_DOCUMENT_BYTES == 64 << 20
    out = tmp_path / "out"
    proc, peak_mb = _prepare_measured(corpus, tokenizer, out, subprocess_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(where, lines[0]) and "split it" in lines[0], proc.stderr[-2000:]
    assert peak_mb < 700, f"prepare peaked at {peak_mb:.0f} MB"
    assert not out.exists()


def test_the_shard_count_advice_names_only_a_smaller_shard_size_than_the_one_used():
    """Few training shards: the advice names a --shard-tokens that gives more files, never one as large as
    (or larger than) the size just used."""
    from utils.data.prepare import _warnings

    def advice(shard_tokens: int, shards: int, tokens: int) -> list[str]:
        description = {"shards": [{"path": f"s{i}.npz", "tokens": 10**6} for i in range(shards)],
                       "validation": {"shards": [], "tokens": 0}, "tokens": tokens, "shard_tokens": shard_tokens}
        return [n for n in _warnings(description) if "--shard-tokens" in n]

    assert advice(16_777_216, 2, 20_000_000) and "--shard-tokens 2,500,000" in advice(16_777_216, 2, 20_000_000)[0]
    assert advice(1024, 3, 9_000) == []  # 9,000 // 8 = 1,125 would be larger than the 1,024 used
    assert advice(1024, 8, 20_000_000) == []


# ------------------------------------------------- prepare's own workers and threads: none is waited on dead

def many_partitions(root: Path, n: int = 6) -> Path:
    """A corpus of `n` files of about 0.2 MB: `n` partitions at --partition-mb 0.2."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    for i in range(n):
        (root / f"d{i}.txt").write_text(text(rng, 36_000))
    return root


def children_of(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def one_error(proc_err: str) -> str:
    assert "Traceback" not in proc_err, proc_err
    lines = [line for line in proc_err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc_err
    return lines[0]


@pytest.mark.slow
def test_a_worker_killed_mid_partition_stops_prepare_with_one_line(tokenizer, tmp_path, subprocess_env):
    """A pool worker SIGKILLed (the kernel's OOM killer) while it holds a partition: multiprocessing.Pool
    waited forever for that partition; now prepare stops within seconds, one line, no worker left."""
    corpus = many_partitions(tmp_path / "corpus")
    env = {**subprocess_env, "NEOX_DEBUG_PARTITION_DELAY_S": "60"}  # every partition is in flight for a minute
    proc = subprocess.Popen(PREPARE + ["--input", str(corpus), "--tokenizer", str(tokenizer), "--output",
                                       str(tmp_path / "out"), "--workers", "2", "--partition-mb", "0.2",
                                       "--shard-tokens", "4096", "--no-progress"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / ".out.staging").glob("p*/shard-*.npz"))) < 2:  # both workers mid-partition
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        workers = children_of(proc.pid)
        assert len(workers) >= 2, workers
        victim = max(workers, key=lambda p: p.memory_info().rss)  # a tokenizing worker, not the resource tracker
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)  # it waited for good on the dead worker's partition
        assert time.monotonic() - killed < 45, "prepare took too long to notice"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "a worker process died while tokenizing" in one_error(err)
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != "zombie"], "a worker outlived prepare"
    assert not (tmp_path / "out").exists()


def wait_for_a_written_partition(proc, gcs_emulator, timeout_s: float = 120):
    """Waits until prepare (`proc`, --output gs://) has written a partition's shard to the emulator; returns
    its worker processes then."""
    bucket = gcs_emulator.client().bucket(gcs_emulator.bucket)
    deadline = time.monotonic() + timeout_s
    while not any(b.name.endswith(".npz") for b in bucket.list_blobs(prefix="sets/")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return children_of(proc.pid)


@pytest.mark.slow
def test_the_bucket_stopping_mid_prepare_is_one_line_in_bounded_time(tokenizer, tmp_path, subprocess_env,
                                                                    gcs_emulator):
    """--output gs://...: the emulator stops while the partitions are being written (and their records are
    still to come): prepare ends non-zero with one line, in bounded time, no worker left."""
    corpus = many_partitions(tmp_path / "corpus", n=4)
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url, "NEOX_DEBUG_PARTITION_DELAY_S": "3"}
    proc = subprocess.Popen(PREPARE + ["--input", str(corpus), "--tokenizer", str(tokenizer), "--output",
                                       f"gs://{gcs_emulator.bucket}/sets/ds", "--workers", "2",
                                       "--partition-mb", "0.2", "--shard-tokens", "4096", "--no-progress"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = wait_for_a_written_partition(proc, gcs_emulator)
        gcs_emulator.stop()
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    # the error came within ~15 s; releasing the lock then waited on the client's own retries (90 s)
    assert proc.returncode == 2 and took < 75, (proc.returncode, took, err[-2000:])
    line = one_error(err)
    assert f"gs://{gcs_emulator.bucket}/sets/.ds.staging/" in line and "failed after" in line, line
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != "zombie"], "a worker outlived prepare"

    started = time.monotonic()  # the emulator down from the start: taking the lock is one line, bounded
    proc = run(PREPARE + ["--input", str(corpus), "--tokenizer", str(tokenizer), "--output",
                          f"gs://{gcs_emulator.bucket}/sets/other", "--no-progress"], env, check=False, timeout=300)
    assert proc.returncode == 2 and time.monotonic() - started < 75, (proc.returncode, proc.stderr[-2000:])
    assert f"cannot take its lock gs://{gcs_emulator.bucket}/sets/.other.lock" in one_error(proc.stderr)


@pytest.mark.slow
def test_sigterm_during_a_prepare_to_a_bucket_ends_it_within_seconds(tokenizer, tmp_path, subprocess_env,
                                                                      gcs_emulator):
    """SIGTERM while the workers write partitions to the emulator (--output gs://): the interrupted line,
    exit 130, within seconds, no worker left."""
    corpus = many_partitions(tmp_path / "corpus", n=4)
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url, "NEOX_DEBUG_PARTITION_DELAY_S": "60"}
    proc = subprocess.Popen(PREPARE + ["--input", str(corpus), "--tokenizer", str(tokenizer), "--output",
                                       f"gs://{gcs_emulator.bucket}/sets/ds", "--workers", "2",
                                       "--partition-mb", "0.2", "--shard-tokens", "4096", "--no-progress"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = wait_for_a_written_partition(proc, gcs_emulator)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 20, (proc.returncode, took, err[-2000:])
    assert "Traceback" not in err and "interrupted: nothing was published" in err, err
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != "zombie"], "a worker outlived prepare"


@pytest.mark.slow
def test_upload_to_a_stopped_bucket_is_one_line_and_sigterm_during_it_ends_it_in_seconds(tokenizer, tmp_path,
                                                                                         subprocess_env,
                                                                                         gcs_emulator):
    """--upload while the emulator does not answer: the upload's retries end in one line (exit 1, the local
    dataset kept) in bounded time; SIGTERM during those retries ends it within seconds (exit 130)."""
    corpus = many_partitions(tmp_path / "corpus", n=2)
    env = {**subprocess_env, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    gcs_emulator.stop()
    args = PREPARE + ["--input", str(corpus), "--tokenizer", str(tokenizer), "--partition-mb", "0.2",
                      "--upload", f"gs://{gcs_emulator.bucket}/sets/ds", "--no-progress"]
    started = time.monotonic()
    proc = run(args + ["--output", str(tmp_path / "a")], env, check=False, timeout=300)
    assert proc.returncode == 1 and time.monotonic() - started < 240, (proc.returncode, proc.stderr[-2000:])
    line = one_error(proc.stderr)
    assert f"upload to gs://{gcs_emulator.bucket}/sets/ds failed" in line and "is complete" in line, line

    proc = subprocess.Popen(args + ["--output", str(tmp_path / "b")], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for out_line in proc.stdout:  # the report line: the upload (and its retries) comes next
            if out_line.startswith("prepared "):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 20, (proc.returncode, took, err[-2000:])
    assert "Traceback" not in err and "interrupted during the upload" in err, err


def test_the_store_threads_raise_the_first_error_at_once_and_wait_on_no_stuck_call():
    """prepare's bucket calls at once (record reads, the merge's moves): results in order; one call's error
    is raised at once while others are stuck (a GCS call that never returns), none of which is waited on
    (ThreadPoolExecutor's `with` waited for every one of them)."""
    import threading

    from utils.data.prepare import threaded_map

    assert threaded_map(lambda x: x * x, range(50), 8, "t") == [x * x for x in range(50)]
    assert threaded_map(lambda x: x, [], 8, "t") == []
    stuck = threading.Event()

    def call(i: int) -> int:
        if i == 5:
            time.sleep(0.2)
            raise OSError("the bucket went away")
        stuck.wait()  # never set: a call that hangs
        return i

    started = time.monotonic()
    with pytest.raises(OSError, match="the bucket went away"):
        threaded_map(call, range(40), 8, "t")
    assert time.monotonic() - started < 10
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-")), "a stuck thread would hold exit"
    stuck.set()
