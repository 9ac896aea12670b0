//! `config.json` in the release layout (spec §1, modelled on golden tiny-a's file): the
//! `KimiK3ForConditionalGeneration` wrapper, `text_config` (with the compressed-tensors
//! `quantization_config`) and `vision_config`, plus the informational fields the release
//! carries that the typed config does not need.

use serde_json::{json, Value};

use crate::config::K3Config;

fn insert_all(obj: &mut Value, extra: Value) {
    if let (Some(o), Value::Object(e)) = (obj.as_object_mut(), extra) {
        for (k, v) in e {
            o.entry(k).or_insert(v);
        }
    }
}

/// The release-layout JSON of a typed config.
pub fn release_config_json(cfg: &K3Config) -> Value {
    let mut top = serde_json::to_value(cfg).expect("the typed config serialises");
    let t = &cfg.text_config;
    if let Some(text) = top.get_mut("text_config") {
        insert_all(
            text,
            json!({
                "architectures": ["KimiLinearForCausalLM"],
                "auto_map": {
                    "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                    "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                    "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"
                },
                "model_type": "kimi_linear",
                "bos_token_id": cfg.bos_token_id,
                "eos_token_id": cfg.eos_token_id,
                "pad_token_id": cfg.pad_token_id,
                "dtype": "bfloat16",
                "num_key_value_heads": t.num_attention_heads,
                "rope_theta": 10000.0,
                "use_grouped_topk": true,
                "use_cache": true
            }),
        );
    }
    if let Some(vision) = top.get_mut("vision_config") {
        insert_all(vision, json!({ "_attn_implementation": "flash_attention_2" }));
    }
    insert_all(
        &mut top,
        json!({
            "auto_map": {
                "AutoConfig": "configuration_kimi_k3.KimiK3Config",
                "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"
            },
            "dtype": "bfloat16",
            "ignore_index": -100
        }),
    );
    top
}
