"""Prompt datasets and the resumable sampler."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.data.prompts import DataConfig, DataError, PromptDataset, PromptSampler, build_prompt_sampler
from megatron_gspo.data.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.fixture
def jsonl(tmp_path):
    records = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)]
    return _write_jsonl(tmp_path / "d.jsonl", records)


def _ids(batch):
    return [p.id for p in batch]


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def test_jsonl_load(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"question": "1+1=", "meta": {"gt": 2}, "id": "q1"},
        "",  # blank lines are skipped
        {"question": [{"role": "user", "content": "hi"}], "meta": {"gt": "x"}},
    ])
    ds = PromptDataset.from_jsonl(path, prompt_key="question", answer_key="meta.gt")
    assert len(ds) == 2
    assert (ds[0].id, ds[0].prompt, ds[0].answer) == ("q1", "1+1=", "2")  # numbers become strings
    assert ds[1].id == "d.jsonl:3" and ds[1].prompt == [{"role": "user", "content": "hi"}]
    assert PromptDataset.from_jsonl(path, prompt_key="question", answer_key=None)[0].answer is None


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    bad_json = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1", "answer": "1"}, '{"prompt": "2", "answer": '])
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid JSON"):
        PromptDataset.from_jsonl(bad_json)
    missing = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1", "answer": "1"}, {"prompt": "2", "solution": "2"}])
    with pytest.raises(DataError, match=r"b\.jsonl:2: missing field 'answer'.*\['prompt', 'solution'\]"):
        PromptDataset.from_jsonl(missing)
    with pytest.raises(DataError, match=r"b\.jsonl:1: missing field 'text'"):
        PromptDataset.from_jsonl(missing, prompt_key="text")
    wrong_type = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: field 'prompt' must be a string"):
        PromptDataset.from_jsonl(wrong_type)
    not_object = _write_jsonl(tmp_path / "e.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"e\.jsonl:1: expected a JSON object"):
        PromptDataset.from_jsonl(not_object)


def test_empty_and_missing_sources(tmp_path):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="empty.jsonl: the dataset contains no examples"):
        PromptDataset.from_config(DataConfig(source=empty))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset.from_config(DataConfig(source=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match=r"\.jsonl or \.parquet"):
        PromptDataset.from_config(DataConfig(source=str(tmp_path / "d.csv")))
    with pytest.raises(ValueError, match="available"):
        PromptDataset.from_config(DataConfig(source="builtin:parity"))


def test_config_validation():
    with pytest.raises(ValueError, match="overlong_prompt_policy='cut'.*'drop', 'truncate_left', 'error'"):
        DataConfig(overlong_prompt_policy="cut")
    with pytest.raises(ValueError, match="max_prompt_length"):
        DataConfig(max_prompt_length=0)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed: Parquet support is optional")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    ds = PromptDataset.from_config(DataConfig(source=path))
    assert [(e.prompt, e.answer) for e in ds] == [("1+1=", "2"), ("2+2=", "4")]
    with pytest.raises(DataError, match="no column 'solution'"):
        PromptDataset.from_parquet(path, answer_key="solution")


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pip install pyarrow"):
        PromptDataset.from_parquet(str(path))


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def test_shuffle_is_deterministic_and_covers_each_epoch(jsonl):
    def draw(seed, shuffle=True):
        s = build_prompt_sampler(DataConfig(source=jsonl, seed=seed, shuffle=shuffle), TOK, batch_size=5)
        return [_ids(s.next_batch()) for _ in range(4)]  # two epochs of 10

    a, b, c = draw(1), draw(1), draw(2)
    assert a == b and a != c
    assert sorted(a[0] + a[1]) == sorted(a[2] + a[3])  # each epoch is a permutation of the data
    assert a[0] + a[1] != a[2] + a[3]  # ...a different one each epoch
    assert draw(1, shuffle=False)[0] == [f"d.jsonl:{i}" for i in range(1, 6)]


@pytest.mark.parametrize("source", ["builtin:arithmetic", "jsonl"])
def test_resume_gives_identical_batches(source, jsonl):
    cfg = DataConfig(source=jsonl if source == "jsonl" else source, task_num_examples=13)
    run = build_prompt_sampler(cfg, TOK, batch_size=4)
    for _ in range(5):  # crosses epoch boundaries (10 or 13 examples per epoch)
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON round trip (checkpoint metadata)
    expected = [run.next_batch() for _ in range(6)]

    resumed = build_prompt_sampler(cfg, TOK, batch_size=4)
    resumed.load_state_dict(state)
    got = [resumed.next_batch() for _ in range(6)]
    assert got == expected
    assert resumed.state_dict() == run.state_dict()


def test_resume_refuses_different_data(jsonl):
    s = build_prompt_sampler(DataConfig(source=jsonl, seed=1), TOK, batch_size=2)
    s.next_batch()
    other = build_prompt_sampler(DataConfig(source=jsonl, seed=2), TOK, batch_size=2)
    with pytest.raises(DataError, match="seed=1 but the current data has seed=2"):
        other.load_state_dict(s.state_dict())
    other.load_state_dict(s.state_dict(), strict=False)
    assert other.position == s.position


def test_tokenization_adds_bos_and_keeps_answers():
    s = build_prompt_sampler(DataConfig(), TOK, batch_size=3)
    for p in s.next_batch():
        assert p.ids == TOK.encode(p.text, add_special_tokens=True) and p.ids[0] == TOK.bos_id
        assert int(p.answer) == sum(int(x) for x in p.text[:-1].split("+"))
    s = build_prompt_sampler(DataConfig(add_special_tokens=False), TOK, batch_size=1)
    p = s.next_batch()[0]
    assert p.ids == TOK.encode(p.text)


def _long_short(tmp_path):
    records = [{"prompt": "x" * n, "answer": "a"} for n in (3, 30, 4, 40, 5)]
    return _write_jsonl(tmp_path / "len.jsonl", records)


def test_overlong_drop(tmp_path):
    cfg = DataConfig(source=_long_short(tmp_path), shuffle=False, max_prompt_length=10)
    s = build_prompt_sampler(cfg, TOK, batch_size=3)
    batch = s.next_batch()
    assert [len(p.text) for p in batch] == [3, 4, 5]
    assert s.num_dropped == 2 and s.num_truncated == 0
    assert s.counters()["num_dropped"] == 2 and s.state_dict()["num_dropped"] == 2


def test_overlong_truncate_left_keeps_bos_and_tail(tmp_path):
    cfg = DataConfig(source=_long_short(tmp_path), shuffle=False, max_prompt_length=10,
                     overlong_prompt_policy="truncate_left")
    s = build_prompt_sampler(cfg, TOK, batch_size=5)
    batch = s.next_batch()
    assert [len(p.ids) for p in batch] == [4, 10, 5, 10, 6]
    assert [p.truncated for p in batch] == [False, True, False, True, False]
    assert batch[1].ids[0] == TOK.bos_id and batch[1].ids[1:] == TOK.encode("x" * 9)
    assert batch[1].text == "x" * 30  # the text stays whole; only the ids are cut
    assert s.num_truncated == 2 and s.num_dropped == 0


def test_overlong_error_names_example(tmp_path):
    cfg = DataConfig(source=_long_short(tmp_path), shuffle=False, max_prompt_length=10,
                     overlong_prompt_policy="error")
    with pytest.raises(DataError, match=r"len\.jsonl:2 .*31 tokens > data.max_prompt_length=10"):
        build_prompt_sampler(cfg, TOK, batch_size=3).next_batch()


def test_everything_dropped_is_an_error_not_a_hang(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 50, "answer": "a"}] * 3)
    s = build_prompt_sampler(DataConfig(source=path, max_prompt_length=8), TOK, batch_size=2)
    with pytest.raises(DataError, match="every example is longer"):
        s.next_batch()


def test_chat_template_prompts(tmp_path):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    tok = CharTokenizer(chat_template=template)
    path = _write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2="}], "answer": "4"},
    ])
    s = build_prompt_sampler(DataConfig(source=path, shuffle=False, apply_chat_template=True), tok, batch_size=2)
    a, b = s.next_batch()
    assert a.text == "<user>1+1=<a>" and a.ids == tok.encode(a.text)  # no extra BOS: the template owns it
    assert b.text == "<system>S<user>2+2=<a>"
    # Chat-message prompts without a chat template are refused by name.
    s = build_prompt_sampler(DataConfig(source=path, shuffle=False), tok, batch_size=2)
    with pytest.raises(DataError, match="chat.jsonl:2.*apply_chat_template=true"):
        s.next_batch()


def test_untokenizable_prompt_names_example(tmp_path):
    path = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "caf\u00e9", "answer": "x"}])
    s = build_prompt_sampler(DataConfig(source=path, shuffle=False), TOK, batch_size=2)
    with pytest.raises(DataError, match=r"u\.jsonl:2 .*cannot encode 'é'"):
        s.next_batch()


def test_task_knobs_reach_the_task():
    cfg = DataConfig(source="builtin:arithmetic", task_num_digits=1, task_operators="*", shuffle=False)
    batch = build_prompt_sampler(cfg, TOK, batch_size=20).next_batch()
    assert all(len(p.text) == 4 and p.text[1] == "*" for p in batch)
    cfg = DataConfig(source="builtin:sort", task_sort_min_len=2, task_sort_max_len=2)
    assert all(len(p.answer.split()) == 2 for p in build_prompt_sampler(cfg, TOK, batch_size=10).next_batch())
    with pytest.raises(DataError, match="data.task_"):
        PromptDataset.from_config(DataConfig(task_operators="/"))


def test_bad_batch_size(jsonl):
    with pytest.raises(DataError, match="positive"):
        PromptSampler(PromptDataset.from_jsonl(jsonl), TOK, DataConfig(source=jsonl), batch_size=0)


# ----------------------------------------------------------------------------------------------
# Messages that say what is wrong and what to do; held-out prompts counted like training prompts
# ----------------------------------------------------------------------------------------------


def test_a_null_field_is_not_called_missing(tmp_path):
    path = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}])
    with pytest.raises(DataError) as e:
        PromptDataset.from_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: field 'answer' (data.answer_key) is null: the record has no reference answer")
    assert "missing" not in msg
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": None, "answer": "2"}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: field 'prompt' \(data.prompt_key\) is null"):
        PromptDataset.from_jsonl(path)


def test_eval_source_errors_name_eval_source(tmp_path):
    from megatron_gspo.data.prompts import build_eval_prompts

    cfg = DataConfig(source=_write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4))
    with pytest.raises(DataError, match=r"^eval\.source='builtin:nope': unknown built-in task 'nope'; "
                                        r"available: \['arithmetic', 'sort'\]$"):
        build_eval_prompts(cfg, "builtin:nope", 4, TOK)
    with pytest.raises(DataError, match=rf"^eval\.source='{tmp_path}' is a directory"):
        build_eval_prompts(cfg, str(tmp_path), 4, TOK)
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(DataError, match=r"^eval\.source='.*d\.jsonl' is a directory, not a data file"):
        build_eval_prompts(cfg, str(tmp_path / "d.jsonl"), 4, TOK)
    with pytest.raises(FileNotFoundError, match=r"^eval\.source: data file not found: .*no\.jsonl"):
        build_eval_prompts(cfg, str(tmp_path / "no.jsonl"), 4, TOK)
    with pytest.raises(DataError, match=r"^eval\.source='x\.txt': expected builtin:<task>"):
        build_eval_prompts(cfg, "x.txt", 4, TOK)
    # data.source's own errors still name data.source
    with pytest.raises(DataError, match=r"^data\.source='builtin:nope'"):
        PromptDataset.from_config(DataConfig(source="builtin:nope"))


def test_held_out_prompts_dropped_for_length_are_counted_and_said(tmp_path, caplog):
    import logging

    from megatron_gspo.data.prompts import build_eval_prompts

    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12345678+1=", "answer": "12345679"},
               {"prompt": "2+2=", "answer": "4"}]
    held_file = _write_jsonl(tmp_path / "test.jsonl", records)
    cfg = DataConfig(max_prompt_length=6, source="builtin:sort")  # (training prompts unlike these: no overlap said)
    with caplog.at_level(logging.WARNING, logger="megatron_gspo"):
        held = build_eval_prompts(cfg, held_file, 8, TOK)
    assert [p.answer for p in held.prompts] == ["2", "4"]
    assert (held.num_records, held.num_dropped, held.num_truncated) == (3, 1, 0)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("evaluation: 1 of 3 held-out prompts dropped and 0 left-truncated "
                                                 "for exceeding data.max_prompt_length=6 tokens"), said
    cut = build_eval_prompts(DataConfig(max_prompt_length=6, overlong_prompt_policy="truncate_left"), held_file, 8, TOK)
    assert (len(cut.prompts), cut.num_dropped, cut.num_truncated) == (3, 0, 1)
    with pytest.raises(DataError, match=r"every one of the 3 held-out prompts is longer than data.max_prompt_length=2"):
        build_eval_prompts(DataConfig(max_prompt_length=2), held_file, 8, TOK)


def test_resume_on_other_data_says_how_to_accept_it(jsonl):
    s = build_prompt_sampler(DataConfig(source=jsonl, seed=1), TOK, batch_size=2)
    other = build_prompt_sampler(DataConfig(source=jsonl, seed=2), TOK, batch_size=2)
    with pytest.raises(DataError) as e:
        other.load_state_dict(s.state_dict())
    assert "strict=False" not in str(e.value)
    assert str(e.value).endswith("accept the change with checkpoint.allow_config_change=[data.seed]")
    other.load_state_dict(s.state_dict(), accept=lambda key: key == "data.seed")
    assert other.position == s.position


# ----------------------------------------------------------------------------------------------
# Damaged files: one error naming the file and line
# ----------------------------------------------------------------------------------------------


def _records(n):
    return [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(n)]


def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_column(tmp_path):
    lines = [r.encode() for r in _records(60)]
    lines[50] = b'{"prompt": "caf\xe9 1+1=", "answer": "2"}'  # latin-1 e-acute on line 51
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"latin1\.jsonl:51: not UTF-8 text \(byte 0xe9 at column 16\)"):
        PromptDataset.from_jsonl(str(path))
    # a byte-order mark (Windows editors) is not an error, and CRLF line ends are not part of a record
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(r.encode() for r in _records(3)) + b"\r\n")
    assert [e.answer for e in PromptDataset.from_jsonl(str(bom))] == ["1", "2", "3"]


def test_invalid_json_names_the_column_of_the_line(tmp_path):
    lines = _records(120)
    lines[100] = '{"prompt": "1+1=", "answer": "2",'  # cut short: the error is at column 34, the line's end
    path = _write_jsonl(tmp_path / "cut.jsonl", lines)
    with pytest.raises(DataError, match=r"cut\.jsonl:101: invalid JSON \(Expecting property name enclosed in double "
                                        r"quotes at column 34\)"):
        PromptDataset.from_jsonl(path)
    lines[100] = '{"prompt": "1+1=", "answer": "2"\r, "id": 7}'  # a CR inside a record is whitespace, not a line end
    assert PromptDataset.from_jsonl(_write_jsonl(tmp_path / "cr.jsonl", lines))[100].id == "7"


@pytest.mark.parametrize("prompt, what", [("", "empty"), ("  \n", "only whitespace")])
def test_a_prompt_with_nothing_in_it_is_refused_at_load(tmp_path, prompt, what):
    lines = _records(5)
    lines[3] = json.dumps({"prompt": prompt, "answer": "1"})
    with pytest.raises(DataError, match=rf"e\.jsonl:4: field 'prompt' \(data.prompt_key\) is {what}"):
        PromptDataset.from_jsonl(_write_jsonl(tmp_path / "e.jsonl", lines))


def test_a_prompt_that_tokenizes_to_nothing_is_refused_when_drawn(tmp_path):
    class Dropping(CharTokenizer):  # a tokenizer that normalizes some text away entirely
        def encode(self, text, add_special_tokens=False):
            return [] if text == "~" else super().encode(text, add_special_tokens)

    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "~", "answer": "x"}])
    s = build_prompt_sampler(DataConfig(source=path, shuffle=False, add_special_tokens=False), Dropping(), batch_size=2)
    with pytest.raises(DataError, match=r"t\.jsonl:2 \(id t\.jsonl:2\): the prompt '~' tokenizes to no tokens"):
        s.next_batch()


def test_a_damaged_parquet_file_is_one_error_naming_it(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow is in the test extras (setup.py)")
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet: not a readable Parquet file \(.*0 bytes\)"):
        PromptDataset.from_parquet(str(empty))
    cut = tmp_path / "cut.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="] * 50, "answer": ["2"] * 50}), str(cut))
    cut.write_bytes(cut.read_bytes()[:-40])  # an interrupted copy: the footer is gone
    with pytest.raises(DataError, match=r"cut\.parquet: not a readable Parquet file"):
        PromptDataset.from_parquet(str(cut))


def test_an_evaluation_on_the_training_task_is_past_its_epoch_and_says_what_it_shares_with_training(tmp_path):
    """eval.source naming data.source's task takes the examples past the training epoch (not the epoch's first 64,
    which training draws), and the prompts they share with training are counted: one-digit sums has 100
    problems, every one trained on, so that evaluation is said not to be held out; six digits has room."""
    import logging

    from log_capture import LogLines
    from megatron_gspo.data.prompts import build_eval_prompts

    small = DataConfig(task_num_digits=1, task_num_examples=1000)
    with LogLines(logging.WARNING) as said:
        held = build_eval_prompts(small, "builtin:arithmetic", 64, TOK)
    assert [p.id for p in held.prompts] == [f"arithmetic-1234-{i}" for i in range(1000, 1064)]
    assert (held.in_training, held.compared, held.training) == (64, 1000, 1000)
    assert held.describe() == ("64 prompts from builtin:arithmetic (past the training epoch) (64 of them training "
                               "prompts too: not held out)")
    assert said.lines == ["evaluation: 64 of the 64 prompts from builtin:arithmetic (past the training epoch) are "
                          "training prompts too (among the 1000 training examples): eval/* measures problems the policy "
                          "trains on, not held-out ones; give eval.source prompts of its own (a file, or a task with "
                          "more distinct problems)"]
    wide = build_eval_prompts(DataConfig(task_num_digits=6, task_num_examples=1000), None, 64, TOK)
    assert wide.in_training == 0 and wide.describe() == ("64 held-out prompts from builtin:arithmetic (past the "
                                                         "training epoch) (none among the 1000 training examples)")
    # a file's held-out records are compared with the records left for training: a duplicate is counted
    records = [{"prompt": f"{i}*{i}=", "answer": str(i * i)} for i in range(10)] + [{"prompt": "3*3=", "answer": "9"}]
    split = build_eval_prompts(DataConfig(source=_write_jsonl(tmp_path / "d.jsonl", records)), None, 2, TOK)
    assert (split.in_training, split.compared) == (1, 9)
