"""The built-in kinds' export formats, one Format each: the exporter (serve/export.py), the validator's table,
config keys, extra checks and forward (serve/export_check.py), and the engines that load the folder. A kind lists
its formats in its registry record (heads/kinds.py) as "draftsmith.serve.formats:NAME"."""

from __future__ import annotations

from functools import partial

from . import export as ex
from . import export_check as ck
from . import export_dflash as dfl
from . import export_peagle as pe
from . import speculators as sp

# vLLM's and SGLang's LlamaForCausalLMEagle3: one folder for both
EAGLE3 = ex.Format(
    export=ex.eagle3_vllm,
    shapes=ck.eagle3_shapes,
    config=ck.eagle3_config,
    forward=ck.eagle3_pairs,
    problems=ck.head_config_problems,
    vllm="eagle3",
    sglang="EAGLE3",
)
EAGLE_VLLM = ex.Format(
    export=ex.eagle_vllm,
    shapes=ck.eagle_shapes,
    config=ck.eagle_config,
    forward=ck.eagle_pairs,
    problems=ck.head_config_problems,
    tensor_checks=ck.moved_bias_problems,
    vllm="eagle",
)
EAGLE_SGLANG = ex.Format(
    export=ex.eagle_sglang,
    shapes=partial(ck.eagle_shapes, fc_bias=True),
    config=partial(ck.eagle_config, arch="LlamaForCausalLMEagle"),
    forward=ck.eagle_pairs,
    problems=ck.head_config_problems,
    token_map=ex.token_map,
    sglang="EAGLE",
)
MEDUSA_VLLM = ex.Format(
    export=ex.medusa_vllm,
    shapes=ck.medusa_shapes,
    config=ck.medusa_vllm_config,
    forward=ck.medusa_pairs,
    vllm="medusa",
)
MEDUSA_TGI = ex.Format(
    export=ex.medusa_tgi,
    shapes=partial(ck.medusa_shapes, tgi=True),
    config=ck.medusa_tgi_config,
    forward=partial(ck.medusa_pairs, tgi=True),
    problems=ck.tgi_problems,
    weights="medusa_lm_head.safetensors",
    torch_dtype=False,
    target_types=("llama", "mistral", "qwen2"),
    tgi=True,
)
# a plain HF causal LM: transformers' assistant_model, vLLM's draft_model, SGLang's STANDALONE
DRAFT_MODEL_HF = ex.Format(
    export=ex.draft_model_hf,
    shapes=ck.draft_model_shapes,
    config=ck.draft_model_config,
    forward=ck.draft_model_pairs,
    problems=ck.tokenizer_problems,
    vllm="draft_model",
    sglang="STANDALONE",
    hf=True,
)
# vLLM's DFlashDraftModel (dflash_config, non-causal block): serve/export_dflash.py
DFLASH_VLLM = ex.Format(
    export=dfl.dflash_vllm,
    shapes=dfl.dflash_shapes,
    config=dfl.dflash_config,
    forward=dfl.dflash_pairs,
    problems=dfl.dflash_problems,
    vllm="dflash",
)
# vLLM's native format, as the speculators package defines it (serve/speculators.py); vLLM serves the folder alone
SPECULATORS = ex.Format(
    export=sp.eagle3_speculators,
    shapes=sp.speculators_shapes,
    config=sp.eagle3_values,
    forward=sp.speculators_pairs,
    problems=sp.speculators_problems,
    vllm="eagle3",
    vllm_alone=True,
)
# P-EAGLE in speculators' `peagle` layout, which vLLM loads as eagle3 drafting all tokens in one forward
PEAGLE_VLLM = ex.Format(
    export=pe.peagle_speculators,
    shapes=pe.peagle_shapes,
    config=pe.peagle_config,
    forward=pe.peagle_pairs,
    problems=pe.peagle_problems,
    vllm="eagle3",
    vllm_options=(("parallel_drafting", True),),
    vllm_alone=True,
)
