"""Unit tests for asyncdiloco.job.dataset and asyncdiloco.job.models (CPU, seconds in all)."""

import math

import pytest
import torch

from asyncdiloco.job.dataset import BatchStream, CharCorpus, eval_batches, load_text, sample_batch, split_batches
from asyncdiloco.job.models import CharTransformerConfig, build_model, evaluate, lm_loss

B, T = 4, 16  # small batches for the shape tests


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus.default()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_config(**overrides) -> CharTransformerConfig:
    fields = dict(vocab_size=65, context_len=16, n_layer=1, n_embd=32, n_head=2)
    fields.update(overrides)
    return CharTransformerConfig(**fields)


# ----------------------------------------------------------------------------- data


def test_embedded_text_and_vocab(corpus):
    text = load_text()
    assert len(text) == 1_115_394
    assert corpus.vocab_size == 65 == len(corpus.vocab)
    assert list(corpus.vocab) == sorted(set(text))


def test_split_is_deterministic_disjoint_and_complete(corpus):
    text = load_text()
    assert corpus.train.numel() + corpus.val.numel() == len(text)
    assert corpus.train.numel() == int(len(text) * 0.9)
    # Train is the head of the text, val the tail: together they are the whole text, in order.
    assert torch.equal(torch.cat([corpus.train, corpus.val]), corpus.encode(text))
    again = CharCorpus.from_text(text)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert corpus.train.dtype == corpus.val.dtype == torch.long


@pytest.mark.parametrize("val_fraction", [0.0, -0.1, 0.6, 1.0])
def test_bad_val_fraction_names_the_value(val_fraction):
    with pytest.raises(ValueError, match=rf"val_fraction={val_fraction!r}.*\(0, 0\.5\]"):
        CharCorpus.from_text("hello world " * 10, val_fraction=val_fraction)


def test_encode_decode_round_trip(corpus):
    s = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = corpus.encode(s)
    assert ids.dtype == torch.long and ids.shape == (len(s),)
    assert corpus.decode(ids) == s
    with pytest.raises(ValueError, match="'#'"):
        corpus.encode("#")
    with pytest.raises(ValueError, match="65"):
        corpus.decode(torch.tensor([65]))


def test_sample_batch_shapes_and_shift(corpus):
    g = torch.Generator().manual_seed(0)
    x, y = sample_batch(corpus.train, B, T, g)
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Every row is a real window of the split.
    text = corpus.decode(corpus.train)
    for row_x, row_y in zip(x, y):
        window = corpus.decode(torch.cat([row_x, row_y[-1:]]))
        assert window in text


def test_sample_batch_rejects_split_shorter_than_context():
    data = torch.arange(10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"10 ids.*context_len=10"):
        sample_batch(data, 2, 10, torch.Generator())
    tiny = CharCorpus.from_text("abcdefghij" * 10)  # 10 val characters
    with pytest.raises(ValueError, match="context_len=64"):
        eval_batches(tiny, 2, 64, 1)
    with pytest.raises(ValueError, match="context_len=95"):
        BatchStream(tiny, 2, 95, seed=0, worker_index=0)


def test_batch_stream_reproducible_per_worker(corpus):
    def first(seed, worker_index, n=3):
        stream = BatchStream(corpus, B, T, seed, worker_index)
        return [next(stream) for _ in range(n)]

    a, again, other_worker, other_seed = first(0, 0), first(0, 0), first(0, 1), first(1, 0)
    for (xa, ya), (xb, yb) in zip(a, again):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], other_worker[0][0])
    assert not torch.equal(a[0][0], other_seed[0][0])
    assert not torch.equal(a[0][0], a[1][0])  # the stream moves on
    with pytest.raises(ValueError, match="worker_index=-1"):
        BatchStream(corpus, B, T, seed=0, worker_index=-1)


def test_eval_batches_fixed_and_from_val(corpus):
    first = eval_batches(corpus, B, T, num_batches=3)
    second = eval_batches(corpus, B, T, num_batches=3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    val_text = corpus.decode(corpus.val)
    assert all(corpus.decode(row) in val_text for x, _ in first for row in x)
    assert not torch.equal(first[0][0], eval_batches(corpus, B, T, 1, seed=1)[0][0])


def test_split_batches_cover_the_validation_split_in_order(corpus):
    batches = split_batches(corpus, B, T)
    windows = (corpus.val.numel() - 1) // T
    assert len(batches) == windows // B and all(x.shape == y.shape == (B, T) for x, y in batches)
    x = torch.cat([x.reshape(-1) for x, _ in batches])  # every window, in order, none twice
    assert torch.equal(x, corpus.val[: x.numel()]) and x.numel() > corpus.val.numel() - B * T - T
    assert torch.equal(torch.cat([y.reshape(-1) for _, y in batches]), corpus.val[1 : x.numel() + 1])
    with pytest.raises(ValueError, match="fewer than batch_size"):
        split_batches(corpus, corpus.val.numel(), 2)


# ---------------------------------------------------------------------------- model


def test_default_config_parameter_count():
    model = build_model(CharTransformerConfig(vocab_size=65), seed=0)
    assert model.num_parameters() == 421_632
    # Untied head: state_dict keys and parameter names are one to one.
    assert list(model.state_dict()) == [name for name, _ in model.named_parameters()]


def test_build_model_is_deterministic_per_seed():
    a, b, c = (build_model(small_config(), seed=s) for s in (7, 7, 8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(small_config(), seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_forward_shapes_and_causality():
    model = build_model(small_config(), seed=0)
    idx = torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (B, T, 65) and logits.dtype == torch.float32
    assert model(idx[:, :5]).shape == (B, 5, 65)
    # Changing the last character does not change earlier predictions.
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 65
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    loss = lm_loss(logits, idx)
    assert loss.shape == () and loss.requires_grad


def test_forward_rejects_too_long_input():
    model = build_model(small_config(context_len=16), seed=0)
    with pytest.raises(ValueError, match=r"T=17 exceeds context_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (dict(n_embd=30, n_head=4), r"n_embd=30 is not divisible by n_head=4"),
        (dict(n_layer=0), r"n_layer=0 must be a positive int"),
        (dict(vocab_size=-1), r"vocab_size=-1 must be a positive int"),
        (dict(dropout=1.0), r"dropout=1.0 is outside \[0, 1\)"),
    ],
)
def test_bad_config_names_the_value(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        small_config(**overrides)


def test_evaluate_restores_mode_and_fresh_loss_is_uniform(corpus, one_thread):
    model = build_model(CharTransformerConfig(vocab_size=corpus.vocab_size), seed=0)
    batches = eval_batches(corpus, 32, 64, num_batches=4)
    assert model.training
    loss = evaluate(model, batches)
    assert model.training
    assert abs(loss - math.log(65)) < 0.3
    model.eval()
    assert evaluate(model, batches) == loss and not model.training


def test_short_training_lowers_held_out_loss(corpus, one_thread):
    model = build_model(CharTransformerConfig(vocab_size=corpus.vocab_size), seed=0)
    batches = eval_batches(corpus, 32, 64, num_batches=4)
    initial = evaluate(model, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = BatchStream(corpus, 32, 64, seed=0, worker_index=0)
    for _ in range(60):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    final = evaluate(model, batches)
    assert final < 3.3 < initial
