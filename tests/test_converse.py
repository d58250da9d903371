"""`chat`: a conversation over several turns whose KV cache is kept between them. Each reply equals
what generate gives for the whole conversation; a turn prefills only the ids the cache lacks
(counted); a template that renders history differently prefills again from where it differs,
and says so; the oldest turns go when the context is full; an interrupted reply leaves a
working session; /save writes what sft reads; both twins, and SmolLM2 through a pipe."""

import io
import subprocess
import sys

import pytest

import jax_llama
import torch_llama
from bridge.chat import ChatTemplate
from tasks.chats import read_chats
from tasks.conversation import Conversation
from bridge.inputs import shared_prefix
from bridge.errors import BridgeError
from bridge.tokenizer import ByteTokenizer
from conftest import save_random_checkpoint, small_config
from jax_llama.inference.generate import ChatSession, generate
from llama_twins.cli import chat as chat_cli
from llama_twins.cli import main as jax_cli
from torch_llama.generate import ChatSession as TorchChatSession

# A ChatML-like template; the byte tokenizer spells its markers byte by byte.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# One that shows earlier replies as a placeholder (as templates that drop earlier reasoning do):
# the conversation so far renders differently from what the cache holds.
FORGETFUL = ("{% for m in messages %}<{{ m['role'] }}>"
             "{% if m['role'] == 'assistant' %}(said){% else %}{{ m['content'] }}{% endif %}"
             "</s>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
STOP = ByteTokenizer().eos_id


@pytest.fixture(scope="module")
def tiny():
    config = small_config(vocab_size=259, max_seq_len=256)
    model, params = jax_llama.init(config, seed=3)
    return model, params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    save_random_checkpoint(path, small_config(vocab_size=259, max_seq_len=160), seed=3,
                           tokenizer=True)
    (path.parent / "template.jinja").write_text(TEMPLATE)
    (path.parent / "forgetful.jinja").write_text(FORGETFUL)
    return path


def talk(session, turns, template=TEMPLATE, max_new_tokens=12):
    """Run `turns` through a Conversation and `session` -> [(prompt ids, reply ids, prefilled,
    reused)] per turn."""
    tok = ByteTokenizer()
    conversation = Conversation(ChatTemplate(template, "test"), tok, 256, max_new_tokens)
    out = []
    for text in turns:
        ids, _ = conversation.ask(text)
        new = session.reply(ids)
        conversation.answer(tok.decode([t for t in new if t != STOP]))
        out.append((ids, new, session.prefilled, session.reused))
    return out


def test_each_reply_is_generate_on_the_whole_conversation_and_prefills_only_new_ids(tiny):
    model, params = tiny
    turns = talk(ChatSession(model, params, 12, stop_ids=[STOP]), ["hello", "and then?", "ok"])
    for i, (ids, new, prefilled, reused) in enumerate(turns):
        assert new == generate(model, params, [ids], 12, stop_ids=[STOP]).tokens[0]
        assert prefilled + reused == len(ids)
        if i == 0:
            assert reused == 0
            continue
        before, reply = turns[i - 1][0], turns[i - 1][1]
        # everything the cache held that the new rendering still starts with: at least the
        # previous prompt (the byte tokenizer has no merges to re-draw)
        assert reused == min(shared_prefix(before + reply[:-1], ids), len(ids) - 1)
        assert reused >= len(before)
        assert prefilled < len(ids) - len(before) + 1


def test_both_twins_give_the_same_replies_and_counts(tiny, checkpoint):
    model, params = jax_llama.load(checkpoint)
    tmodel = torch_llama.load(checkpoint, device="cpu")
    turns = ["hi there", "why?", "tell me more"]
    jax_turns = talk(ChatSession(model, params, 10, stop_ids=[STOP]), turns, max_new_tokens=10)
    torch_turns = talk(TorchChatSession(tmodel, 10, stop_ids=[STOP]), turns, max_new_tokens=10)
    assert jax_turns == torch_turns


def test_a_template_that_renders_history_differently_prefills_from_where_it_differs(tiny):
    model, params = tiny
    (ids1, new1, _, _), (ids2, new2, prefilled, reused) = talk(
        ChatSession(model, params, 12, stop_ids=[STOP]), ["hello", "again"], template=FORGETFUL)
    assert ids2[:len(ids1)] == ids1
    # the reply is in the cache, "(said)" in the new rendering: reuse ends where they part
    assert reused == len(ids1) + shared_prefix(new1, ids2[len(ids1):])
    assert reused < len(ids1) + len(new1) - 1
    assert new2 == generate(model, params, [ids2], 12, stop_ids=[STOP]).tokens[0]


def test_an_interrupted_reply_leaves_a_session_that_starts_over(tiny):
    model, params = tiny
    tok = ByteTokenizer()
    ids = ChatTemplate(TEMPLATE, "t").encode([{"role": "user", "content": "hey"}], tok, True)
    session = ChatSession(model, params, 12)
    heard = []

    def interrupt(row, token):
        heard.append(token)
        if len(heard) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.reply(ids, interrupt)
    assert session.cache is None and session.cached == []
    again = session.reply(ids)
    assert session.reused == 0 and again[:3] == heard
    assert again == generate(model, params, [ids], 12).tokens[0]


def test_the_oldest_turns_go_when_the_context_is_full():
    tok = ByteTokenizer()
    conversation = Conversation(ChatTemplate(TEMPLATE, "t"), tok, 120, 20, system="be kind")
    for i in range(3):
        ids, dropped = conversation.ask(f"question number {i} " + "x" * 10)
        assert len(ids) + 20 <= 120
        conversation.answer("answer " * 3)
    assert dropped > 0 and conversation.dropped >= 2
    assert conversation.messages[0] == {"role": "system", "content": "be kind"}
    assert conversation.messages[1]["role"] == "user"
    assert "question number 0" not in str(conversation.messages)
    with pytest.raises(BridgeError, match="does not fit the context of 120 tokens"):
        conversation.ask("y" * 200)
    assert conversation.messages[-1]["role"] == "assistant"  # the refused turn is not kept


def run_chat(argv, lines, capsys):
    """`jax-llama chat ARGV` with `lines` on a piped stdin -> (exit code, stdout, stderr)."""
    stdin = sys.stdin
    try:
        sys.stdin = io.StringIO("".join(line + "\n" for line in lines))
        code = jax_cli.main(["chat", *map(str, argv)])
    finally:
        sys.stdin = stdin
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_chat_through_a_pipe_replies_saves_resets_and_counts(checkpoint, tmp_path, capsys):
    template = checkpoint.parent / "template.jinja"
    saved = tmp_path / "chats.jsonl"
    code, out, err = run_chat(
        [checkpoint, "--chat-template", template, "--max-new-tokens", "8", "--stats"],
        ["hello", "", "more please", f"/save {saved}", "/reset", "hello", "/exit", "never read"],
        capsys)
    assert code == 0, err
    replies = out.split("\n\n")
    assert len(replies) == 4 and replies[-1] == ""  # three replies, each followed by an empty line
    assert replies[0] == replies[2]  # after /reset the same question gets the same answer
    assert "(the conversation is reset)" in err and f"(saved to {saved})" in err
    # a reset conversation is not one that renders as other tokens
    assert "prefilled again" not in err.split("(the conversation is reset)")[1]
    stats = [line for line in err.splitlines() if line.startswith("[prefilled")]
    assert len(stats) == 3
    assert "0 from the cache" in stats[0] and "0 from the cache" not in stats[1]
    ((where, messages),) = read_chats(saved)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert messages[2]["content"] == "more please"


def test_chat_says_when_history_renders_differently_and_when_turns_drop(checkpoint, capsys):
    code, out, err = run_chat(
        [checkpoint, "--chat-template", checkpoint.parent / "forgetful.jinja", "--max-new-tokens",
         "8"], ["first", "second"], capsys)
    assert code == 0 and "renders as other tokens than the cache holds" in err
    code, out, err = run_chat(
        [checkpoint, "--chat-template", checkpoint.parent / "template.jinja", "--max-new-tokens",
         "40"], [f"turn {i} " + "z" * 30 for i in range(4)], capsys)
    assert code == 0 and "oldest turns are dropped" in err
    assert out.count("\n\n") == 4


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "160"], "--max-new-tokens: must be less than the context, 160 tokens"),
    (["--chat-template", "nowhere.jinja"], "nowhere.jinja"),
    (["--temperature", "-1"], "temperature: must be >= 0"),
])
def test_chat_refusals(checkpoint, capsys, argv, message):
    code, out, err = run_chat([checkpoint, *argv], ["hi"], capsys)
    assert code == 2 and message in err and out == ""


def test_a_turn_too_long_is_refused_and_the_chat_goes_on(checkpoint, capsys):
    code, out, err = run_chat(
        [checkpoint, "--chat-template", checkpoint.parent / "template.jinja", "--max-new-tokens",
         "8"], ["w" * 400, "short"], capsys)
    assert code == 0 and "does not fit the context of 160 tokens" in err
    assert out.count("\n\n") == 1


def test_converse_keeps_the_chat_after_an_interrupted_reply(capsys):
    tok = ByteTokenizer()

    class Interrupted:
        """A session whose first reply is interrupted after two tokens."""
        cached, prefilled, reused, calls = [], 0, 0, 0

        def reply(self, ids, on_token):
            self.calls += 1
            for t in b"ok":
                on_token(0, t)
            if self.calls == 1:
                raise KeyboardInterrupt
            return list(b"ok") + [STOP]

    conversation = Conversation(ChatTemplate(TEMPLATE, "t"), tok, 256, 8)
    stdin = io.StringIO("one\ntwo\n")
    assert chat_cli.converse(conversation, Interrupted(), tok, stdin=stdin) == 0
    captured = capsys.readouterr()
    assert captured.out == "ok\n\nok\n\n" and "(stopped)" in captured.err
    assert [m["content"] for m in conversation.messages] == ["one", "ok", "two", "ok"]


def test_smollm2_chat_through_a_pipe_remembers(smollm2):
    """The real model, as a user types it: the second turn needs the first, and the cache
    serves the whole first exchange."""
    run = subprocess.run(
        ["jax-llama", "chat", str(smollm2), "--max-new-tokens", "24", "--stats"],
        input="What is the capital of France?\nAnd of Germany?\n", capture_output=True,
        text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first, second, rest = run.stdout.split("\n\n")
    assert "Paris" in first and "Berlin" in second and rest == ""
    stats = [line for line in run.stderr.splitlines() if line.startswith("[prefilled")]
    prompt1 = int(stats[0].split()[1])
    reused2 = int(stats[1].split(", ")[1].split()[0])
    assert reused2 >= prompt1  # the first prompt and its reply came from the cache


@pytest.mark.parametrize("twin, extra", [("jax", ["--quantize", "int8"]),
                                         ("torch", ["--device", "cpu"]),
                                         ("torch", ["--device", "cpu", "--quantize", "int8"])])
def test_chat_int8_and_the_torch_twin(checkpoint, capsys, twin, extra):
    """int8 and the torch twin's chat through the same loop: two replies, the second turn served
    from the cache, the torch twin's float replies equal to the JAX twin's."""
    from llama_twins.cli import torch_main

    argv = ["chat", str(checkpoint), "--chat-template", str(checkpoint.parent / "template.jinja"),
            "--max-new-tokens", "6", "--stats", *extra]
    stdin = sys.stdin
    try:
        outs = []
        for main in ((jax_cli.main, torch_main.main) if twin == "torch" else (jax_cli.main,)):
            sys.stdin = io.StringIO("hello\nagain\n")
            args = argv if main is torch_main.main else [a for a in argv if a not in
                                                         ("--device", "cpu")]
            assert main(args) == 0
            outs.append(capsys.readouterr())
    finally:
        sys.stdin = stdin
    out, err = outs[-1].out, outs[-1].err
    assert out.count("\n\n") == 2
    stats = [line for line in err.splitlines() if line.startswith("[prefilled")]
    assert "0 from the cache" in stats[0] and "0 from the cache" not in stats[1]
    if twin == "torch" and "int8" not in extra:
        assert outs[0].out == out
