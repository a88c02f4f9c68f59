"""Evaluation (`minigpt.eval`) against lm-evaluation-harness's own reference, its `hf` model.

Tiny checkpoints written by transformers, a Llama 3 (its tiktoken-made tokenizer adds a begin
token) and a GPT-2 (tiktoken's own vocabulary, no begin token, imported and exported through
`minigpt.hub`), are scored by the harness with its `hf` model and with `minigpt` on the same
files, on small tasks written here in the harness's own format (a YAML beside a JSON-lines file:
these machines cannot download the real ones) and run through the real harness: multiple
choice, log-likelihood of a continuation (the reference model's own greedy continuations among
them, an empty context, a context past the model's), rolling log-likelihood past the context
and generation until a stop string. Every request's log-likelihood equals the reference's to
1e-4, every greedy flag and generation is the same, accuracies and exact matches identical and
perplexities within 1e-5. `--text` gives the bits per byte of the model's own token losses summed
by hand (1e-5), and of transformers' on the same windows. The command line writes the harness's
files in its layout; a user's mistake is one `error:` line, exit status 2. With -m slow: every
kind of preset gives the same scores; a chat-template generation task; the command line with
`--preset` and `--devices` in a process of its own.

Needs lm-evaluation-harness (the [eval] extra) and torch, transformers and sentencepiece (the
[hf] extra); skipped, saying why, without them.
"""

import json
import math
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, child_env, refused

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the [eval] extra: "
                                      "pip install \"minigpt[eval]\"")
torch = pytest.importorskip("torch", reason="torch is the [hf] extra (a large download)")
transformers = pytest.importorskip("transformers", reason="transformers is the [hf] extra")
pytest.importorskip("sentencepiece", reason="sentencepiece (the [hf] extra) is needed to write "
                                            "the test checkpoints")

import hf_families as hf  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from minigpt import hub  # noqa: E402
from minigpt.eval import MiniGPTLM, load, score_texts  # noqa: E402
from minigpt.eval.cli import main  # noqa: E402
from minigpt.eval.scoring import bucket  # noqa: E402

STORY = ("Once upon a time, there was a little cat named Tom. Tom liked to play with a red ball "
         "in the garden. One day, the ball rolled under the fence and Tom could not reach it. ")
EXACT = ("acc,none", "acc_norm,none", "exact_match,none")  # counts of agreements: identical


# --- tasks in the harness's own format ---------------------------------------------------------

def write_tasks(folder, *, prefix: str, greedy: list[tuple[str, str]], stop: str) -> list[str]:
    """The tasks `<prefix>_mc`, `_ll`, `_roll` and `_gen` in `folder` (a YAML and a JSON-lines
    file each); `greedy`: (context, continuation) pairs the log-likelihood task scores besides
    an empty context and one past the model's; `stop`: the generation task's stop string."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = {
        "mc": [{"question": "What does the cat chase?", "choices": ["a mouse", "the sky",
                                                                   "a song"], "label": 0},
               {"question": "Where do fish live?", "choices": ["in water", "in trees"],
                "label": 0},
               {"question": "Pick one.", "choices": ["A", "B", "C", "D"], "label": 2},
               {"question": "What color is grass?", "choices": ["blue", "green", "red"],
                "label": 1}],
        "ll": [*({"context": c, "continuation": t} for c, t in greedy),
               {"context": "", "continuation": "Once upon a time"},  # the prefix token's path
               {"context": STORY * 8, "continuation": " The end."}],  # past the context
        "roll": [{"text": "The sun was bright and the birds sang."}, {"text": STORY * 6}],
        "gen": [{"question": "What does the cat chase?", "answer": " a mouse"},
                {"question": "Where do fish live?", "answer": " in water"},
                {"question": "Tell me about Tom.", "answer": " Tom is a cat"}],
    }
    fields = {
        "mc": ("multiple_choice", 'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
               'doc_to_target: "{{label}}"\ndoc_to_choice: "{{choices}}"\n'
               "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "ll": ("loglikelihood", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
               "metric_list:\n  - metric: perplexity\n  - metric: acc\n"),
        "roll": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                 "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                 "  - metric: bits_per_byte\n"),
        "gen": ("generate_until", 'doc_to_text: "Q: {{question}}\\nA:"\n'
                'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n'
                f"  until: [{json.dumps(stop)}]\n  max_gen_toks: 10\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n"),
    }
    names = []
    for kind, rows in docs.items():
        data = folder / f"{prefix}_{kind}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in rows))
        output_type, body = fields[kind]
        (folder / f"{prefix}_{kind}.yaml").write_text(
            f"task: {prefix}_{kind}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\n  cache_dir: {folder / 'cache'}\noutput_type: {output_type}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")
        names.append(f"{prefix}_{kind}")
    return names


def reference_tasks(folder, prefix: str, model, tokenizer) -> list[str]:
    """Tasks whose greedy continuations and stop string come from the reference model: its
    3-token greedy continuation of two contexts, and a character from the middle of its
    continuation of the first generation prompt."""
    def continued(text: str, count: int) -> str:
        ids = tokenizer(text)["input_ids"]
        return tokenizer.decode(hf.greedy(model, ids, count), skip_special_tokens=True)

    pairs = [(c, continued(c, 3)) for c in ("Once upon a time, there was", "Tom liked")]
    generated = continued("Q: What does the cat chase?\nA:", 10)
    stop = next((ch for ch in generated[len(generated) // 2:] if ch.strip()), "e")
    return write_tasks(folder, prefix=prefix, greedy=pairs, stop=stop)


def evaluate(model, names, tasks, **options):
    # Only the tasks written here: indexing the harness's own 14,000 task files takes 10 s.
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=names, log_samples=True, bootstrap_iters=0,
                                   task_manager=manager, **options)


def reference(directory, names, tasks):
    """The harness's own `hf` model on a checkpoint folder, float32 on the CPU, one request at
    a time (its generations depend on what shares a batch)."""
    return evaluate("hf", names, tasks, batch_size=1, model_args={
        "pretrained": str(directory), "dtype": "float32", "device": "cpu"})


def assert_same_scores(ours, theirs, names) -> None:
    """Every request's answer and every metric, task by task."""
    for name in names:
        pairs = list(zip(ours["samples"][name], theirs["samples"][name], strict=True))
        assert pairs, name
        for mine, ref in pairs:
            assert mine["doc_id"] == ref["doc_id"] and mine["arguments"] == ref["arguments"]
            for a, b in zip(mine["resps"], ref["resps"], strict=True):
                a, b = a[0], b[0]
                if isinstance(b, str):  # a generation
                    assert a == b, (name, mine["doc_id"])
                elif isinstance(b, tuple):  # (log-likelihood, greedy)
                    assert a[1] == b[1], (name, mine["doc_id"], a, b)
                    np.testing.assert_allclose(a[0], b[0], rtol=1e-4, atol=1e-4,
                                               err_msg=f"{name} {mine['doc_id']}")
                else:  # a rolling log-likelihood
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4,
                                               err_msg=f"{name} {mine['doc_id']}")
        mine, ref = ours["results"][name], theirs["results"][name]
        assert mine.keys() == ref.keys()
        for key, value in ref.items():
            if key in EXACT:
                assert mine[key] == value, (name, key)
            elif isinstance(value, float) and not math.isnan(value):
                assert mine[key] == pytest.approx(value, rel=1e-5), (name, key)


# --- the Llama-shaped checkpoint, in the quick suite -------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama 3 written by transformers, imported; its tasks; the harness's hf model's
    scores on them."""
    root = tmp_path_factory.mktemp("llama")
    ck = hf.write_family("llama3", root / "hf")
    assert hub.main(["import", str(ck.directory), "--out", str(root / "run")]) == 0
    names = reference_tasks(root / "tasks", "llama", ck.model, ck.tokenizer)
    return {"checkpoint": ck, "run": root / "run", "tasks": root / "tasks", "names": names,
            "reference": reference(ck.directory, names, root / "tasks")}


@pytest.fixture(scope="module")
def llama_lm(llama):
    return MiniGPTLM(run=str(llama["run"]), batch_size=4, progress=False)


@pytest.fixture(scope="module")
def llama_scores(llama, llama_lm):
    return evaluate(llama_lm, llama["names"], llama["tasks"])


def test_llama_scores_equal_the_harness_hf_models_request_for_request(llama, llama_scores):
    theirs = llama["reference"]
    assert_same_scores(llama_scores, theirs, llama["names"])
    flags = [r[0][1] for s in theirs["samples"]["llama_ll"] for r in s["resps"]]
    assert True in flags and False in flags  # greedy flags are seen both ways
    generations = [s["resps"][0][0] for s in theirs["samples"]["llama_gen"]]
    assert any(0 < len(g) < 20 for g in generations)  # a generation cut at its stop string


def test_the_harness_knows_the_model_by_name(llama, llama_lm):
    from lm_eval.api.registry import get_model

    assert get_model("minigpt") is MiniGPTLM
    made = MiniGPTLM.create_from_arg_string(f"run={llama['run']},preset=dp,batch_size=2",
                                            {"batch_size": None, "device": "cpu"})
    assert made.max_length == 128 and made.batch == 2
    bos = llama["checkpoint"].tokenizer.bos_token_id
    assert made.prefix_token_id == llama_lm.prefix_token_id == bos


def test_requests_are_scored_in_a_few_padded_lengths():
    lengths = sorted({bucket(n, 1024) for n in range(1, 1025)})
    assert lengths == [16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448,
                       512, 640, 768, 896, 1024]  # a row is at most a quarter padding from 64 on
    assert all(bucket(n, 1024) <= max(1.25 * n, 16, 1.5 * n if n < 64 else 0)
               for n in range(1, 1025))
    assert sorted({bucket(n, 1024, steps=1) for n in range(1, 1025)}) == [
        16, 32, 64, 128, 256, 512, 1024]
    assert {bucket(n, 128, 8) % 8 for n in range(1, 129)} == {0}
    assert max(bucket(n, 100) for n in range(1, 101)) == 100


# --- bits per byte of any text -------------------------------------------------------------------

def hand_windows(length: int, context: int, stride: int):
    """(inputs from, inputs to, predictions counted from) for a document of `length` tokens:
    predictions 1 .. length - 1, each once, the first window's all, each later window's after
    the window before."""
    done, out = 0, []
    while done < length - 1:
        end = min(length - 1, context if done == 0 else done + stride)
        out.append((max(0, end - context), end, done))
        done = end
    return out


def test_text_bits_per_byte_is_the_models_own_token_losses_summed_and_transformers(
        llama, tmp_path):
    stories = [(STORY * 6).strip(), "The dog ran home.", STORY[:90]]
    one = tmp_path / "stories.txt"
    one.write_text("\n<|endoftext|>\n".join(stories[:2]) + "\n")
    other = tmp_path / "more.txt"
    other.write_text(stories[2])
    evaluated = load(llama["run"])
    files, total = score_texts(evaluated, [one, other], stride=48, batch_size=4, progress=False)

    model, tokenizer, context = evaluated.model, evaluated.tokenizer, evaluated.context
    torch_model = llama["checkpoint"].model
    forward = jax.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))
    ours = theirs = 0.0
    for story in stories:
        tokens = [tokenizer.bos_token, *tokenizer.encode_ordinary(story)]
        for start, end, done in hand_windows(len(tokens), context, 48):
            window = np.zeros((1, context), np.int32)  # causality hides the padding
            window[0, :end - start] = tokens[start:end]
            with evaluated.active():
                logp = np.asarray(forward(model, jnp.asarray(window)))[0]
            with torch.no_grad():
                ref = torch.log_softmax(torch_model(torch.tensor([tokens[start:end]])).logits[0],
                                        -1).numpy()
            for t in range(done, end):  # predicting token t + 1 at input position t - start
                ours -= float(logp[t - start, tokens[t + 1]])
                theirs -= float(ref[t - start, tokens[t + 1]])
    text_bytes = sum(len(s.encode("utf-8")) for s in stories)
    assert total.bytes == text_bytes and files[0].documents == 2
    assert total.tokens == sum(len(tokenizer.encode_ordinary(s)) for s in stories)
    assert total.bits_per_byte == pytest.approx(ours / math.log(2) / text_bytes, rel=1e-5)
    assert total.bits_per_byte == pytest.approx(theirs / math.log(2) / text_bytes, rel=1e-5)
    assert total.loss == pytest.approx(ours / total.tokens, rel=1e-5)
    assert len(hand_windows(len(tokenizer.encode_ordinary(stories[0])) + 1, context, 48)) > 2


# --- the command line -------------------------------------------------------------------------

def test_the_command_line_writes_the_harness_files_in_its_layout(llama, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["--run", str(llama["run"]), "--tasks", "llama_mc,llama_gen", "--include-path",
                 str(llama["tasks"]), "--limit", "2", "--log-samples", "--out", str(out),
                 "--batch-size", "4"]) == 0
    assert "llama_mc" in capsys.readouterr().out  # the harness's table
    (folder,) = out.iterdir()  # named after the run, as the harness names the hf model's
    assert folder.name == str(llama["run"]).replace("/", "__")
    (results,) = folder.glob("results_*.json")
    written = json.loads(results.read_text())
    expected = {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                "config", "model_name", "model_name_sanitized", "task_hashes", "date"}
    assert expected <= written.keys()
    assert written["config"]["model"] == "minigpt" and written["n-samples"]["llama_mc"] == {
        "original": 4, "effective": 2}
    for task in ("llama_mc", "llama_gen"):
        (samples,) = folder.glob(f"samples_{task}_*.jsonl")
        lines = [json.loads(line) for line in samples.read_text().splitlines()]
        assert [s["doc_id"] for s in lines] == [0, 1] and "resps" in lines[0]


def test_text_on_the_command_line_and_json(llama, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text(STORY)
    assert main(["--run", str(llama["run"]), "--text", str(text), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"]["bytes"] == len(STORY.strip().encode())
    assert printed["files"][0]["bits_per_byte"] == pytest.approx(
        printed["total"]["loss"] * printed["total"]["tokens"] / math.log(2)
        / printed["total"]["bytes"])


@pytest.mark.parametrize("args, says", [
    (["--run", "{missing}", "--text", "{text}"], "does not exist"),
    (["--run", "{run}", "--text", "{missing}"], "no such file"),
    # The harness indexes its own 14,000 task files to say a name is none of them (10 s).
    pytest.param(["--run", "{run}", "--tasks", "hellaswog", "--include-path", "{tasks}"],
                 "unknown task hellaswog (did you mean hellaswag", marks=pytest.mark.slow),
    (["--run", "{run}", "--tasks", "llama_mc", "--include-path", "{missing}"], "not a folder"),
    (["--run", "{run}", "--text", "{binary}"], "not UTF-8"),
    (["--run", "{run}", "--text", "{folder}"], "is a folder, not a text file"),
    (["--run", "{run}", "--tasks", "llama_mc", "--include-path", "{tasks}", "--limit", "-1"],
     "--limit must be a number of documents (1 or more) or a fraction"),
    (["--run", "{run}", "--tasks", "llama_mc", "--include-path", "{tasks}", "--limit", "0"],
     "--limit must be"),
    (["--run", "{run}", "--tasks", "llama_mc", "--include-path", "{broken}"],
     "llama_mc.jsonl:3 is not a JSON object per line"),
])
def test_a_users_mistake_is_one_line_and_status_2(llama, tmp_path, capsys, args, says):
    (tmp_path / "story.txt").write_text(STORY)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00story")
    broken = tmp_path / "broken"
    shutil.copytree(llama["tasks"], broken)
    (data,) = broken.glob("llama_mc.jsonl")
    data.write_text("\n".join([*data.read_text().splitlines()[:2], '{"question": "cut']) + "\n")
    places = {"missing": str(tmp_path / "nowhere"), "text": str(tmp_path / "story.txt"),
              "run": str(llama["run"]), "tasks": str(llama["tasks"]),
              "binary": str(tmp_path / "binary.txt"), "folder": str(tmp_path),
              "broken": str(broken)}
    refused(capsys, main([a.format(**places) for a in args]), says)


# --- with -m slow: the GPT-2 checkpoint, presets, chat templates, a process of its own ----------

@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory, gpt2):
    """A tiny GPT-2 written by transformers without tokenizer files, imported (so the run reads
    tiktoken's `gpt2`) and exported (the export carries the tokenizer files the hf model needs);
    its tasks and the hf model's scores on the export."""
    root = tmp_path_factory.mktemp("gpt2")
    model = hf.randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4)))
    model.save_pretrained(root / "hf")
    assert hub.main(["import", str(root / "hf"), "--out", str(root / "run")]) == 0
    assert hub.main(["export", "--run", str(root / "run"), "--out", str(root / "export")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "export").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "export")
    names = reference_tasks(root / "tasks", "gpt2", exported, tokenizer)
    return {"run": root / "run", "tasks": root / "tasks", "names": names,
            "reference": reference(root / "export", names, root / "tasks")}


@pytest.mark.slow
def test_gpt2_scores_equal_the_harness_hf_models_request_for_request(gpt2_checkpoint):
    ours = evaluate(MiniGPTLM(run=str(gpt2_checkpoint["run"]), batch_size=3, progress=False),
                    gpt2_checkpoint["names"], gpt2_checkpoint["tasks"])
    assert_same_scores(ours, gpt2_checkpoint["reference"], gpt2_checkpoint["names"])


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "tp", "dp_tp", "dp_pp", "cp"])
def test_every_kind_of_preset_gives_the_same_scores(llama, llama_scores, preset):
    lm = MiniGPTLM(run=str(llama["run"]), preset=preset, batch_size=4, progress=False)
    assert_same_scores(evaluate(lm, llama["names"], llama["tasks"]), llama_scores,
                       llama["names"])


@pytest.mark.slow
def test_generation_through_the_chat_template_equals_the_hf_models(tmp_path):
    ck = hf.write_family("llama3-instruct", tmp_path / "hf")
    assert hub.main(["import", str(ck.directory), "--out", str(tmp_path / "run")]) == 0
    names = write_tasks(tmp_path / "tasks", prefix="chat", greedy=[("Tom", " is")], stop="\n\n")
    names = ["chat_gen", "chat_mc"]
    options = {"apply_chat_template": True, "system_instruction": hf.CHAT_SYSTEM}
    theirs = evaluate("hf", names, tmp_path / "tasks", batch_size=1, **options, model_args={
        "pretrained": str(ck.directory), "dtype": "float32", "device": "cpu"})
    ours = evaluate(MiniGPTLM(run=str(tmp_path / "run"), batch_size=2, progress=False), names,
                    tmp_path / "tasks", **options)
    assert_same_scores(ours, theirs, names)
    prompt = ours["samples"]["chat_gen"][0]["arguments"][0][0]
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system")


@pytest.mark.slow
def test_the_command_line_under_a_preset_on_simulated_devices(llama, tmp_path):
    text = tmp_path / "story.txt"
    text.write_text(STORY * 3)
    here = score_texts(load(llama["run"]), [text], progress=False)[1]
    done = subprocess.run(
        [sys.executable, "-m", "minigpt.eval", "--run", str(llama["run"]), "--text", str(text),
         "--preset", "fsdp", "--devices", "4", "--json"],
        capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["total"]["bits_per_byte"] == pytest.approx(
        here.bits_per_byte, rel=1e-5)
