"""SmolLM2-135M-Instruct loaded from its GGUF file (skipped when the file is absent).

    python -m minagent.weights fetch          # once, 98 MB
    python -m pytest tests/engine/test_weights.py -q

Known answers: SmolLM2-135M's published config (30 layers, d_model 576, ...), and a greedy reply that names
Paris. A truncated copy and a missing path fail with messages that say what to do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minagent import gguf, model, tokenfile, weights

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
IM_END = 2


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    params, cfg = weights.load_params(smollm2_gguf)
    return params, cfg, tokenfile.from_gguf(smollm2_gguf)


def greedy(params, cfg, prompt_ids, n_new, length=32):
    """Greedy decoding by whole forward passes over one fixed padded length (one compilation).

    Causal attention makes the padding after position n invisible to position n.
    """
    forward = jax.jit(model.forward, static_argnums=1)
    ids_1xT = np.full((1, length), IM_END, np.int32)
    ids_1xT[0, :len(prompt_ids)] = prompt_ids
    n = len(prompt_ids)
    for _ in range(min(n_new, length - n)):
        next_id = int(jnp.argmax(forward(params, cfg, jnp.asarray(ids_1xT))[0, n - 1]))
        ids_1xT[0, n] = next_id
        n += 1
        if next_id == IM_END:
            break
    return ids_1xT[0, len(prompt_ids):n].tolist()


def test_config_matches_the_model_card(smollm2):
    params, cfg, _ = smollm2
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (cfg.rope_theta, cfg.vocab_size, cfg.tie_embeddings) == (100000.0, 49152, True)
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert "unembed" not in params                                   # tied: the head is embed.T
    assert model.n_params(params) == 134_515_008                     # "135M"


@pytest.mark.slow
def test_greedy_answer_names_paris(smollm2):
    params, cfg, tok = smollm2
    prompt_ids = tok.encode(PROMPT)
    assert prompt_ids[:3] == [1, 4093, 198]                          # <|im_start|> "user" "\n", atomically
    reply = tok.decode(greedy(params, cfg, prompt_ids, n_new=12))
    assert "Paris" in reply, reply                                   # seen: "The capital of France is Paris."


@pytest.mark.slow
def test_bfloat16_load_agrees_on_the_next_token(smollm2, smollm2_gguf):
    params, cfg, tok = smollm2
    params_bf16, cfg_bf16 = weights.load_params(smollm2_gguf, dtype="bfloat16")
    assert cfg_bf16.dtype == "bfloat16" and params_bf16["layers"]["wq"].dtype == jnp.bfloat16
    ids_1xT = jnp.array([tok.encode(PROMPT)])
    exact_V = model.forward(params, cfg, ids_1xT)[0, -1]
    low_V = model.forward(params_bf16, cfg_bf16, ids_1xT)[0, -1]
    assert int(jnp.argmax(low_V)) == int(jnp.argmax(exact_V))      # "The"


@pytest.mark.parametrize("keep", [100_000, 50_000_000])            # inside the tokenizer's metadata; inside the tensors
def test_truncated_copy_is_a_clear_error(smollm2_gguf, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(gguf.GGUFError, match="truncated") as err:
        weights.load_params(cut)
    assert str(cut) in str(err.value) and "python -m minagent.weights fetch" in str(err.value)


def test_missing_path_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m minagent.weights fetch"):
        weights.load_params(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_path_can_be_set_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINAGENT_SMOLLM2", str(tmp_path / "elsewhere.gguf"))
    assert weights.smollm2_path() == tmp_path / "elsewhere.gguf"
    monkeypatch.delenv("MINAGENT_SMOLLM2")
    assert weights.smollm2_path().name == weights.GGUF_NAME


def test_only_llama_is_supported():
    with pytest.raises(gguf.GGUFError, match="'gpt2' is not supported"):
        weights.config_from_meta({"general.architecture": "gpt2"}, tie_embeddings=True)
