"""Downstream evals (utils/evals/, scripts/evaluate.py, `eval_tasks`): the readers of the published layouts,
the config forms, lm-evaluation-harness itself as the reference for scores and log-likelihoods, and the
evals in a 2-rank FSDP run against scripts/evaluate.py on its sharded checkpoint. The demo model's scores
(trained and untrained, in the loop and through scripts/evaluate.py) are checked in tests/e2e/test_demo.py."""
from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainkit import REPO_ROOT, metrics, run, train_cmd

WORDS = ("the a man woman dog cat house river car road tree garden kitchen knife water bread table chair door "
         "window light paper book pen cup plate shirt shoe ball game team song voice hand face eye head hair "
         "opens closes takes puts holds cuts pours washes walks runs jumps reads writes sings plays turns "
         "slowly quickly then again carefully inside outside over under into onto near far small big red "
         "green old new café naïve über señor crème").split()  # non-ASCII: acc_norm counts characters, not bytes
FOLLOWS = dict(zip(WORDS, random.Random(1).sample(WORDS, len(WORDS))))  # each word's likely successor


def sentence(rng: random.Random, low: int, high: int, start: str | None = None) -> str:
    """Words of a Markov chain: mostly each word's successor in FOLLOWS, sometimes any word (learnable text)."""
    words, length = [start or rng.choice(WORDS)], rng.randint(low, high) + (start is not None)
    while len(words) < length:
        words.append(FOLLOWS[words[-1]] if rng.random() < 0.8 else rng.choice(WORDS))
    return " ".join(words[start is not None:])


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------------------------ readers

def test_published_layouts_parse_to_their_contexts_choices_and_gold(tmp_path):
    from utils.evals.tasks import load_task

    hellaswag = write_jsonl(tmp_path / "hellaswag_val.jsonl", [
        {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
         "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain", "source_id": "x",
         "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                     "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": 3},
        {"ind": 92, "activity_label": "Finance and Business", "ctx_a": "[header] How to buy a car [title] Look",
         "ctx_b": "around.", "endings": [" [step] Check  prices. ", "Ask [substeps] a friend.", "Walk away.",
                                         "Buy it [title] now."], "label": "0"},
    ])
    task = load_task(hellaswag)
    assert (task.name, task.layout, task.kind, task.metrics) == ("hellaswag_val", "hellaswag", "multiple_choice",
                                                                  ("acc", "acc_norm"))
    first, second = task.examples
    assert first.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert first.choices[3] == "starts pulling up roofing on a roof." and first.gold == 3 and first.delimiter == " "
    assert second.context == "Finance and Business: How to buy a car. Look Around."
    assert second.choices == (" Check prices.", "Ask a friend.", "Walk away.", "Buy it. now.") and second.gold == 0
    assert first.requests()[0] == (first.context, " is using wrap to wrap a pair of skis.")

    piqa = write_jsonl(tmp_path / "piqa" / "valid.jsonl", [
        {"goal": "How do I ready a guinea pig cage?", "sol1": "Fill it with cedar.", "sol2": "Fill it with hay."},
        {"goal": "dresser", "sol1": "can hold a hat", "sol2": "can hold a house"}])
    (tmp_path / "piqa" / "valid-labels.lst").write_text("1\n0\n")
    task = load_task(piqa, "piqa")
    assert task.layout == "piqa" and [e.gold for e in task.examples] == [1, 0]
    assert task.examples[0].context == "Question: How do I ready a guinea pig cage?\nAnswer:"
    assert task.examples[0].choices == ("Fill it with cedar.", "Fill it with hay.")
    inline = write_jsonl(tmp_path / "piqa_hf.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}])
    assert load_task(inline).examples[0].gold == 1  # the HF export's layout: the label in the record

    arc = write_jsonl(tmp_path / "ARC-Easy-Dev.jsonl", [
        {"id": "Mercury_7", "question": {"stem": "Which is a mammal?", "choices": [
            {"text": "shark", "label": "A"}, {"text": "whale", "label": "B"}, {"text": "trout", "label": "C"},
            {"text": "eel", "label": "D"}]}, "answerKey": "B"},
        {"id": "NYSED_1", "question": {"stem": "2 + 2?", "choices": [
            {"text": "3", "label": "1"}, {"text": "4", "label": "2"}, {"text": "5", "label": "3"}]}, "answerKey": "2"}])
    task = load_task(arc)
    assert task.name == "ARC-Easy-Dev" and task.layout == "arc"
    assert task.examples[0].context == "Question: Which is a mammal?\nAnswer:"
    assert task.examples[0].choices == ("shark", "whale", "trout", "eel") and task.examples[0].gold == 1
    assert task.examples[1].choices == ("3", "4", "5") and task.examples[1].gold == 1

    lambada = write_jsonl(tmp_path / "lambada_test.jsonl", [{"text": "he said it was over , and then left with john"}])
    task = load_task(lambada)
    assert (task.layout, task.kind, task.metrics) == ("lambada", "cloze", ("acc", "ppl"))
    assert task.examples[0].requests() == [("he said it was over , and then left with", " john")]

    plain = write_jsonl(tmp_path / "mine.jsonl", [
        {"context": "def f(x):\n", "choices": ["    return x", "import os"], "gold": 0, "target_delimiter": ""},
        {"context": "2 + 2 =", "choices": ["4", "5"], "gold": 0}] * 3)
    task = load_task(plain, limit=2)
    assert task.layout == "multiple_choice" and len(task.examples) == 2
    assert task.examples[0].requests() == [("def f(x):\n", "    return x"), ("def f(x):\n", "import os")]
    assert task.examples[1].requests()[1] == ("2 + 2 =", " 5")
    cloze = write_jsonl(tmp_path / "cloze.jsonl", [{"context": "The capital of France is", "target": " Paris"}])
    assert load_task(cloze).examples[0].requests() == [("The capital of France is", " Paris")]


@pytest.mark.parametrize("lines, fragment", [
    (['{"text": "a b"}', "{not json"], "line 2: not valid JSON"),
    (['{"question": "q", "answer": 1}'], "line 1: no known layout"),
    (['{"context": "c", "choices": ["a", "b"], "gold": 2}'],
     "line 1 (multiple_choice layout): gold must be an index from 0 to 1"),
    (['{"context": "c", "choices": ["a"], "gold": 0}'], "choices' must be a list of at least 2"),
    (['{"ctx_a": "a", "ctx_b": "b", "activity_label": "x", "endings": ["a", "b"], "label": ""}'], "unlabelled"),
    (['{"goal": "g", "sol1": "a", "sol2": "b"}'], "valid-labels.lst"),
    (['{"question": {"stem": "s", "choices": [{"text": "a", "label": "A"}, {"text": "b", "label": "B"}]}, '
      '"answerKey": "E"}'], "answerKey 'E' is not one of"),
    (['[1, 2]'], "line 1: expected a JSON object"),
    ([], "holds no examples"),
])
def test_a_bad_task_file_is_one_line_naming_the_file_and_line(tmp_path, lines, fragment):
    from utils.evals.tasks import TaskFileError, load_task

    path = tmp_path / "valid.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskFileError) as err:
        load_task(path)
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message, message


def test_task_file_not_utf8_and_missing(tmp_path):
    from utils.evals.tasks import TaskFileError, load_task

    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "a b"}\n{"text": "caf\xe9 b"}\n')
    with pytest.raises(TaskFileError, match=r"line 2: not UTF-8"):
        load_task(path)
    with pytest.raises(TaskFileError, match="cannot read it"):
        load_task(tmp_path / "missing.jsonl")


def test_a_bad_task_file_stops_train_py_before_training_in_one_line(tmp_path, subprocess_env):
    from tests.trainkit import make_shards

    data = make_shards(tmp_path / "data")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"context": "c", "choices": ["a", "b"], "gold": 0}])
    bad.write_text(bad.read_text() + "{oops\n")
    proc = run(train_cmd(tmp_path / "out", data, "max_steps=2", f"eval_tasks=mine={bad}"), subprocess_env,
               check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: task file {bad}, line 2: not valid JSON")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "checkpoints").exists()


def test_evaluate_py_errors_are_one_line(tmp_path, capsys):
    from scripts import evaluate
    from utils.errors import UserError
    from utils.evals.runner import load_encoder

    good = write_jsonl(tmp_path / "good.jsonl", [{"context": "c", "target": " d"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"context": "c", "choices": ["a", "b"], "gold": 5}])
    cases = [([str(tmp_path / "nowhere"), "--task", str(bad)], f"error: task file {bad}, line 1"),
             ([str(tmp_path / "nowhere"), "--task", str(good)], "no such directory"),
             ([str(good), "--task", str(good)], f"{good}: a file, not a directory; give the folder of a checkpoint"),
             ([str(tmp_path), "--task", str(good), "--samples", str(tmp_path / "no" / "s.jsonl")], "--samples"),
             ([str(tmp_path), "--task", str(good)], "not a checkpoint, an HF model directory"),
             ([str(tmp_path), "--task", str(good), "--limit", "-1"], "--limit must not be negative")]
    for argv, fragment in cases:
        assert evaluate.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert fragment in err[-1] and err[-1].startswith("error: "), (argv, err)
    with pytest.raises(UserError, match=f"no tokenizer.json in {tmp_path}, so the tasks' text cannot be tokenized"):
        load_encoder(tmp_path, 64, advice="x")


def test_requests_are_split_as_lm_eval_splits_them():
    """Trailing whitespace of the context moves to the continuation; an empty context is the prefix token;
    the model reads the last max_length tokens but the last."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from utils.evals.scoring import RequestEncoder, model_input

    vocab = {c: i for i, c in enumerate(["<eos>", "a", "b", "Ġ", "Ċ", "Ġa", "ab"])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "a"), ("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens(["<eos>"])
    encoder = RequestEncoder(tokenizer, prefix_id=0, max_length=4)
    assert encoder.pair("ab ", "a") == ([6], [5])  # " a" is one token: the space went to the continuation
    assert encoder.pair("a\n", "b") == ([1], [4, 2])
    assert encoder.pair("", "ab") == ([0], [6])
    with pytest.raises(ValueError, match="only whitespace"):
        encoder.pair("  ", "a")
    assert model_input([1, 2, 3, 4], [5, 6], max_length=4) == [2, 3, 4, 5]


def test_eval_tasks_config_forms(tmp_path):
    from configs import ConfigError, get_training_config, parse_overrides
    from configs.training_config import read_config_file

    assert parse_overrides(["eval_tasks=hs=data/hellaswag_val.jsonl,data/piqa/valid.jsonl"])["eval_tasks"] == {
        "hs": "data/hellaswag_val.jsonl", "valid": "data/piqa/valid.jsonl"}
    assert parse_overrides(['eval_tasks=["a/x.jsonl", "y=b/z.jsonl"]'])["eval_tasks"] == {"x": "a/x.jsonl",
                                                                                         "y": "b/z.jsonl"}
    config = tmp_path / "run.yaml"
    config.write_text("base: demo\neval_tasks: [a/lambada_test.jsonl, {}]\n")
    with pytest.raises(ConfigError, match="is not a file path"):
        read_config_file(config)
    config.write_text("base: demo\neval_tasks: {piqa: a/valid.jsonl}\neval_tasks_limit: 50\n")
    _, _, fields = read_config_file(config)
    cfg = get_training_config(str(config))
    assert cfg.eval_tasks == {"piqa": "a/valid.jsonl"} and fields["eval_tasks_limit"] == 50
    config.write_text("base: demo\neval_tasks: [a/lambada_test.jsonl, b/x.jsonl]\n")
    assert get_training_config(str(config)).eval_tasks == {"lambada_test": "a/lambada_test.jsonl", "x": "b/x.jsonl"}
    with pytest.raises(ConfigError, match="two tasks named 'valid'"):
        parse_overrides(["eval_tasks=a/valid.jsonl,b/valid.jsonl"])
    with pytest.raises(ConfigError, match="task name 'a b'"):
        parse_overrides(["eval_tasks=a b=x.jsonl"])
    with pytest.raises(ConfigError, match="must be at least 0"):
        get_training_config("demo", {"eval_tasks_limit": -1})


# --------------------------------------------------------------------- lm-evaluation-harness as the reference

@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A tokenizer trained on standard-library text (512 ids), a tiny GPT-NeoX with 128 positions trained
    briefly on a Markov chain's text and exported to HF format, and task files: HellaSwag and LAMBADA (>= 200
    examples each; some LAMBADA texts run past the 128 positions, so left truncation is compared too), the
    demo's next-line task (its contexts end in a newline, its choices follow with no delimiter), small ARC
    and PIQA files, each in its published layout and in the layout lm-eval's own task reads."""
    from configs.model_config import get_model_spec
    from utils.data.demo import read_stdlib_corpus, train_tokenizer
    from utils.evals.demo_task import build_next_line_task
    from utils.model import build_model
    from utils.model.hf import export_hf

    root = tmp_path_factory.mktemp("evals")
    (root / "tokenizer").mkdir()
    tokenizer = train_tokenizer(read_stdlib_corpus(300_000)[1], 512)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    spec = replace(get_model_spec("tiny"), max_position_embeddings=128)
    rng = random.Random(0)
    model = train_briefly(build_model(spec, seed=0), tokenizer, [sentence(rng, 5, 30) + "." for _ in range(3000)])
    export_hf(model.state_dict(), spec, root / "model", tokenizer=root / "tokenizer")

    tasks = root / "tasks"
    hellaswag = []
    for i in range(200):
        ctx_a, ctx_b = sentence(rng, 4, 20), sentence(rng, 1, 6)
        endings = [sentence(rng, 3, 12, start=rng.choice(WORDS)) + "." for _ in range(4)]
        label = rng.randrange(4)
        endings[label] = sentence(rng, 3, 12, start=ctx_b.split()[-1]) + "."  # the chain goes on
        endings[i % 3] = endings[i % 3].replace(" the ", " [title] the ", 1).replace(" a ", "  a ", 1)
        hellaswag.append({"ind": i, "activity_label": sentence(rng, 1, 3).capitalize(), "ctx_b": ctx_b,
                          "ctx_a": ("[header] " if i % 5 == 0 else "") + ctx_a + ".", "endings": endings,
                          "label": label})
    write_jsonl(tasks / "hellaswag_val.jsonl", hellaswag)
    write_jsonl(tasks / "lambada_test.jsonl", [{"text": sentence(rng, 5, 60 if i % 10 == 0 else 25)}
                                               for i in range(210)])
    build_next_line_task(tasks / "next_line.jsonl", count=60)
    arc = []
    for i in range(30):
        keys = "ABCD" if i % 2 else "1234"
        arc.append({"id": f"q{i}", "question": {"stem": sentence(rng, 4, 10) + "?", "choices": [
            {"text": sentence(rng, 1, 4), "label": k} for k in keys[:3 + i % 2]]}, "answerKey": keys[i % 3]})
    write_jsonl(tasks / "ARC-Easy-Dev.jsonl", arc)
    piqa = [{"goal": sentence(rng, 3, 9), "sol1": sentence(rng, 2, 8), "sol2": sentence(rng, 2, 8)} for _ in range(30)]
    piqa_labels = [rng.randrange(2) for _ in piqa]
    write_jsonl(tasks / "piqa" / "valid.jsonl", piqa)
    (tasks / "piqa" / "valid-labels.lst").write_text("".join(f"{label}\n" for label in piqa_labels))

    # what lm-eval's own arc / piqa tasks read: the HF datasets' layouts of the same records
    hf = root / "hf_layout"
    write_jsonl(hf / "arc.jsonl", [{"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
                                    "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                                                "label": [c["label"] for c in r["question"]["choices"]]}}
                                   for r in arc])
    write_jsonl(hf / "piqa.jsonl", [r | {"label": label} for r, label in zip(piqa, piqa_labels)])
    files = {"hellaswag": tasks / "hellaswag_val.jsonl", "lambada": tasks / "lambada_test.jsonl",
             "next_line": tasks / "next_line.jsonl", "arc_easy": tasks / "ARC-Easy-Dev.jsonl",
             "piqa": tasks / "piqa" / "valid.jsonl"}
    return {"root": root, "spec": spec, "model": root / "model", "files": files, "hf_layout": hf}


def train_briefly(model, tokenizer, texts: list[str], steps: int = 100):
    """A few AdamW steps on `texts` (the Markov chain's): a model with preferences, so the scores compared with
    lm-eval's are not those of a uniform guess."""
    import torch

    stream = torch.tensor([t for e in tokenizer.encode_batch(texts) for t in e.ids + [0]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only waits for a second thread
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(stream) - 65, (16,), generator=generator)
            loss = model(torch.stack([stream[s:s + 65] for s in starts]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def lm_eval_task_yamls(toy) -> Path:
    """lm-eval's own hellaswag, lambada_openai, arc_easy and piqa task definitions (`include`), each over the
    local JSON file instead of the hub's dataset, and the next-line task as a plain multiple_choice YAML."""
    import lm_eval

    own = Path(lm_eval.__file__).parent / "tasks"
    files, hf = toy["files"], toy["hf_layout"]
    out = toy["root"] / "lm_eval_tasks"
    out.mkdir(exist_ok=True)

    def local(task: str, include: str, split: str, path: Path) -> str:
        return (f"include: {own / include}\ntask: {task}\ntag: []\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    {split}: {path}\ntraining_split: null\n"
                f"validation_split: {'validation' if split == 'validation' else 'null'}\ntest_split: "
                f"{'test' if split == 'test' else 'null'}\n")

    (out / "hellaswag.yaml").write_text(local("toy_hellaswag", "hellaswag/hellaswag.yaml", "validation",
                                              files["hellaswag"]))
    (out / "lambada.yaml").write_text(local("toy_lambada", "lambada/lambada_openai.yaml", "test", files["lambada"]))
    (out / "arc.yaml").write_text(local("toy_arc_easy", "arc/arc_easy.yaml", "test", hf / "arc.jsonl"))
    (out / "piqa.yaml").write_text(local("toy_piqa", "piqa/piqa.yaml", "validation", hf / "piqa.jsonl"))
    (out / "next_line.yaml").write_text(
        f"task: toy_next_line\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {files['next_line']}\n"
        f"test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\ndoc_to_choice: choices\n"
        f"doc_to_target: gold\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return out


@pytest.mark.slow
def test_scores_and_loglikelihoods_equal_lm_evaluation_harness(toy, tmp_path, subprocess_env):
    """lm-eval's CLI (`--model hf` on the exported model, its own task definitions over the same local files,
    offline) and the project (scripts/evaluate.py, its --samples for the log-likelihoods) on the same model: equal acc
    and acc_norm on every multiple-choice task, equal cloze acc and ppl, each log-likelihood within 1e-4."""
    include = lm_eval_task_yamls(toy)
    env = subprocess_env | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_HOME": str(tmp_path / "hf_home"), "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    names = {"hellaswag": "toy_hellaswag", "lambada": "toy_lambada", "next_line": "toy_next_line",
             "arc_easy": "toy_arc_easy", "piqa": "toy_piqa"}
    run([str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "hf", "--model_args",
         f"pretrained={toy['model']},dtype=float32", "--tasks", ",".join(names.values()), "--include_path",
         str(include), "--device", "cpu", "--batch_size", "32", "--log_samples", "--output_path",
         str(tmp_path / "lm_eval_out")], env, timeout=600)
    results = json.loads(next((tmp_path / "lm_eval_out").rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in names.values():
        path = next((tmp_path / "lm_eval_out").rglob(f"samples_{task}_*.jsonl"))
        rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["doc_id"])
        samples[task] = [[float(resp[0]) for resp in row["filtered_resps"]] for row in rows]

    evaluated = run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), str(toy["model"]), "--json",
                     "--batch-size", "7", "--samples", str(tmp_path / "samples.jsonl")]
                    + [f"--task={name}={path}" for name, path in toy["files"].items()], subprocess_env)
    ours = json.loads(evaluated.stdout)
    our_samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    worst = 0.0
    for name, lm_name in names.items():
        mine = [s["loglikelihoods"] for s in our_samples if s["task"] == name]
        assert len(mine) == len(samples[lm_name]) == ours[name]["examples"], name
        assert len(mine) >= {"hellaswag": 200, "lambada": 200}.get(name, 30), name
        for ll, lm_ll in zip(mine, samples[lm_name]):
            assert len(ll) == len(lm_ll), name
            worst = max(worst, max(abs(a - b) for a, b in zip(ll, lm_ll)))
        reference = results[lm_name]
        if ours[name]["layout"] == "lambada":
            assert ours[name]["acc"] == reference["acc,none"], name
            assert math.isclose(ours[name]["ppl"], reference["perplexity,none"], rel_tol=1e-4), name
        else:
            for metric in ("acc", "acc_norm"):
                assert ours[name][metric] == reference[f"{metric},none"], (name, metric)
    assert worst < 1e-4, worst
    # the comparison means something: the model learnt the chain, and some last words are its greedy guess
    assert results["toy_hellaswag"]["acc,none"] > 0.3 and 0.1 < results["toy_lambada"]["acc,none"] < 0.9, results


# ------------------------------------------------------------------------------------ in the training loop

@pytest.mark.slow
def test_fsdp_ranks_score_in_the_loop_as_evaluate_py_scores_the_sharded_checkpoint(toy, tmp_path, subprocess_env):
    """2 FSDP ranks (gloo) score next_line and lambada in the loop at steps 0 and 4, split over the ranks (65
    requests in batches of 4: one rank runs a one-token forward where the other runs its ninth batch); the
    rows are in metrics.jsonl and TensorBoard (eval/<task>/<metric>); scripts/evaluate.py on the step-4
    sharded checkpoint (and its tokenizer.json) gives the same scores."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.trainkit import TINY, make_shards

    data = make_shards(tmp_path / "data")
    (data / "tokenizer.json").write_bytes((toy["root"] / "tokenizer" / "tokenizer.json").read_bytes())
    out = tmp_path / "out"
    tasks = f"eval_tasks=next_line={toy['files']['next_line']},lambada={toy['files']['lambada']}"
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", "--strategy", "fsdp",
           "--", "--output-dir", str(out), "--data-dir", str(data)]
    for s in TINY + ["max_steps=4", "save_steps=4", "eval_interval=4", "per_device_train_batch_size=4", tasks,
                     "eval_tasks_limit=13", "report_to=tensorboard"]:
        cmd += ["--set", s]
    proc = run(cmd, subprocess_env, timeout=600)
    assert "eval_tasks: next_line (multiple_choice, 13 examples, 52 requests); lambada (lambada, 13 examples, " \
           "13 requests)" in proc.stdout
    rows = {r["step"]: r for r in metrics(out) if "eval_tasks_s" in r}
    assert sorted(rows) == [0, 4]
    keys = {"eval/next_line/acc", "eval/next_line/acc_norm", "eval/lambada/acc", "eval/lambada/ppl"}
    assert keys <= set(rows[4]) and all(0 <= rows[4][k] <= 1 for k in keys - {"eval/lambada/ppl"})
    events = EventAccumulator(str(out / "logs" / "tensorboard")).Reload()
    assert keys <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("eval/next_line/acc")] == [0, 4]
    assert events.Scalars("eval/lambada/ppl")[-1].value == pytest.approx(rows[4]["eval/lambada/ppl"], rel=1e-6)

    checkpoint = next((out / "checkpoints").glob("checkpoint-epoch*-step4-files*"))
    assert (checkpoint / "dcp").is_dir()
    evaluated = run([sys.executable, str(REPO_ROOT / "scripts" / "evaluate.py"), str(checkpoint), "--json",
                     "--limit", "13", f"--task=next_line={toy['files']['next_line']}",
                     f"--task=lambada={toy['files']['lambada']}"], subprocess_env)
    scores = json.loads(evaluated.stdout)
    for key in keys:
        _, task, metric = key.split("/")
        assert scores[task][metric] == pytest.approx(rows[4][key], rel=1e-5, abs=0), key
