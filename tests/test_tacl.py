"""TaCL: masking statistics, the token-level contrastive loss against a loop reference (values and
gradients), and a real forward/backward with the teacher staying frozen."""
from __future__ import annotations

import math

import pytest
import torch

from clsys.recipes import load_config
from clsys.data.masking import Masker
from clsys.model.encoder import load_tokenizer
from clsys.objectives.tacl import TaCL, token_contrastive_loss


def test_masking_statistics_on_thousands_of_sequences():
    g = torch.Generator().manual_seed(0)
    special = (0, 100, 101, 102, 103)  # pad, unk, cls, sep, mask (BERT ids)
    masker = Masker(mask_id=103, special_ids=special, vocab_size=1000, probability=0.15, cap=20)
    batch, length = 4000, 160
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    attention = (torch.arange(length) < lengths[:, None]).long()
    ids = torch.randint(104, 1000, (batch, length), generator=g)
    ids[:, 0] = 101
    ids[torch.arange(batch), lengths - 1] = 102
    ids[torch.rand(batch, length, generator=g) < 0.02] = 100  # a few [UNK]s: never chosen either
    ids = ids.masked_fill(attention == 0, 0)

    corrupted, chosen = masker(ids, attention, generator=g)
    candidates = attention.bool() & ~torch.isin(ids, torch.tensor(special))
    assert not (chosen & ~candidates).any(), "a special token or pad was chosen"
    expected = [min(20, max(1, round(0.15 * int(n)))) for n in lengths]
    got = chosen.sum(1).tolist()
    for e, g_, c in zip(expected, got, candidates.sum(1).tolist()):
        assert g_ == min(e, c)
    assert torch.equal(corrupted[~chosen], ids[~chosen])
    as_mask = (corrupted == 103) & chosen
    unchanged = (corrupted == ids) & chosen
    randomised = chosen & ~as_mask & ~unchanged
    total = chosen.sum().item()
    assert abs(as_mask.sum().item() / total - 0.8) < 0.01
    assert abs(unchanged.sum().item() / total - 0.1) < 0.01 + 1 / 900  # a random draw can equal the original
    assert abs(randomised.sum().item() / total - 0.1) < 0.01
    assert not torch.isin(corrupted[randomised], torch.tensor(special)).any()


def naive_token_cl(student, teacher, chosen, candidates, tau):
    def cos(u, v):
        return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))

    total, count = 0.0, 0
    for b in range(student.shape[0]):
        for i in range(student.shape[1]):
            if not chosen[b, i]:
                continue
            s = student[b, i].tolist()
            denom = sum(math.exp(cos(s, teacher[b, j].tolist()) / tau)
                        for j in range(student.shape[1]) if candidates[b, j])
            total += -math.log(math.exp(cos(s, teacher[b, i].tolist()) / tau) / denom)
            count += 1
    return total / count


@pytest.mark.parametrize("batch,length,pads_are_negatives", [(1, 5, False), (3, 7, False), (3, 7, True), (4, 9, False)])
def test_token_contrastive_loss_matches_loop_reference(batch, length, pads_are_negatives):
    g = torch.Generator().manual_seed(batch * 10 + length)
    student = torch.randn(batch, length, 6, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(batch, length, 6, generator=g, dtype=torch.float64, requires_grad=True)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    attention = torch.arange(length) < lengths[:, None]
    chosen = attention & (torch.rand(batch, length, generator=g) < 0.5)
    chosen[:, 0] = True
    candidates = torch.ones_like(attention) if pads_are_negatives else attention

    loss, _ = token_contrastive_loss(student, teacher, chosen, candidates, 0.07)
    assert loss.item() == pytest.approx(naive_token_cl(student, teacher, chosen, candidates, 0.07), rel=1e-10)

    # Gradients against a differentiable dense reference (same formula, computed element by element).
    loss.backward()
    got = student.grad.clone(), teacher.grad.clone()
    student.grad = teacher.grad = None
    terms = []
    for b, i in chosen.nonzero().tolist():
        sims = torch.stack([torch.cosine_similarity(student[b, i], teacher[b, j], dim=0) / 0.07
                            for j in range(length) if candidates[b, j]])
        cols = [j for j in range(length) if candidates[b, j]]
        terms.append(torch.logsumexp(sims, 0) - sims[cols.index(i)])
    torch.stack(terms).mean().backward()
    torch.testing.assert_close(got[0], student.grad)
    torch.testing.assert_close(got[1], teacher.grad)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A small random BERT with the packaged tokenizer, saved like any local model folder."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_teacher_stays_frozen_and_the_mlm_head_is_tied(tiny_model):
    cfg = load_config("tacl", [f"model.name={tiny_model}", "data.max_length=32"])
    tokenizer = load_tokenizer(tiny_model)
    objective = TaCL(cfg, tokenizer)
    objective.train()
    assert not objective.teacher.training and objective.model.training
    head = objective.mlm_head.predictions.decoder.weight
    assert head.data_ptr() == objective.model.get_input_embeddings().weight.data_ptr()

    trainable = [p for p in objective.parameters() if p.requires_grad]
    teacher_ids = {id(p) for p in objective.teacher.parameters()}
    assert trainable and not teacher_ids & {id(p) for p in trainable}
    before = {k: v.clone() for k, v in objective.teacher.state_dict().items()}
    student_before = objective.model.embeddings.word_embeddings.weight.clone()

    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    texts = [{"txt": t} for t in ["The cat sat on the mat in the sun.", "Stocks fell sharply on Monday morning.",
                                   "A short one.", "Rivers flow into the sea after heavy rain."]]
    for _ in range(3):
        out = objective(objective.collate(texts))
        assert torch.isfinite(out.loss) and {"mlm_loss", "token_cl_loss"} <= set(out.metrics)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    for k, v in objective.teacher.state_dict().items():
        assert torch.equal(v, before[k]), f"teacher parameter {k} changed"
    assert not torch.equal(objective.model.embeddings.word_embeddings.weight, student_before)


def test_fixed_padding_switch_pads_to_max_length(tiny_model):
    cfg = load_config("tacl", [f"model.name={tiny_model}", "data.max_length=24", "objective.pad_negatives=true",
                               "model.packed=false"])
    batch = TaCL(cfg, load_tokenizer(tiny_model)).collate([{"txt": "One sentence."}, {"txt": "Another, longer one."}])
    assert batch["input_ids"].shape == (2, 24)
    assert not (batch["chosen"] & (batch["attention_mask"] == 0)).any()


PASSAGES = [
    {"txt": "The river rises in the hills. It flows east for forty miles. It reaches the sea at the port.",
     "json": {"lang": "en", "page_id": 1}},
    {"txt": "The castle was built in stone. Its walls are three metres thick. A moat surrounds the keep.",
     "json": {"lang": "en", "page_id": 2}},
]


def test_nsp_pairs_are_continuations_or_from_another_page():
    import random

    from clsys.objectives.tacl import nsp_pairs

    rng, labels = random.Random(0), []
    for _ in range(400):
        firsts, seconds, batch_labels = nsp_pairs(PASSAGES, rng)
        for sample, a, b, label in zip(PASSAGES, firsts, seconds, batch_labels):
            assert sample["txt"].startswith(a)
            other = PASSAGES[1 - PASSAGES.index(sample)]["txt"]
            assert (b in other) if label else sample["txt"] == f"{a} {b}"
        labels += batch_labels
    assert abs(sum(labels) / len(labels) - 0.5) < 0.05


def test_nsp_adds_a_pair_classification_loss(tiny_model):
    cfg = load_config("tacl", [f"model.name={tiny_model}", "data.max_length=48", "objective.nsp_weight=1.0"])
    objective = TaCL(cfg, load_tokenizer(tiny_model))
    assert objective.model.pooler is None, "the exported encoder must stay pooler-free"
    batch = objective.collate(PASSAGES * 2)
    assert batch["token_type_ids"].max() == 1 and batch["nsp_labels"].shape == (4,)
    out = objective(batch)
    parts = out.metrics["mlm_loss"] + out.metrics["token_cl_loss"] + out.metrics["nsp_loss"]
    torch.testing.assert_close(out.loss.detach(), parts)
    out.loss.backward()
    assert objective.nsp_head[1].weight.grad.abs().sum() > 0
