//! Loading a model's tokenizer checks the files against each other: chat markers inside the
//! special block that tiktoken.model's rank count implies, config.json's eos / media ids spelled
//! as K3 spells them. Built on the trained tiny-t model's files.

use mac_decoder::tokenizer::Tokenizer;
use serde_json::Value;

fn copy_model() -> (tempfile::TempDir, Value, Value) {
    let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/models/tiny-t");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("tiktoken.model"), dir.path().join("tiktoken.model")).unwrap();
    let tc: Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap()).unwrap();
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    (dir, tc, cfg)
}

fn write(dir: &std::path::Path, tc: &Value, cfg: &Value) {
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

#[test]
fn mismatched_tokenizer_files_are_refused_with_the_cause() {
    let (dir, tc, cfg) = copy_model();
    write(dir.path(), &tc, &cfg);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.special_id("<|end_of_msg|>"), cfg["eos_token_id"].as_u64().map(|x| x as u32));

    // config.json's eos id names another token.
    let mut bad = cfg.clone();
    bad["eos_token_id"] = Value::from(tok.special_id("<|open|>").unwrap());
    write(dir.path(), &tc, &bad);
    let e = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("eos_token_id") && e.contains("<|open|>") && e.contains("<|end_of_msg|>"), "{e}");

    // tokenizer_config.json puts a chat marker among the base ranks (a tokenizer_config of
    // another vocabulary size).
    let mut bad = tc.clone();
    let entry = bad["added_tokens_decoder"].as_object_mut().unwrap().remove(&tok.special_id("<|sep|>").unwrap().to_string()).unwrap();
    bad["added_tokens_decoder"].as_object_mut().unwrap().insert("17".into(), entry);
    write(dir.path(), &bad, &cfg);
    let e = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(e.contains("<|sep|>") && e.contains("id 17") && e.contains("ranks"), "{e}");
}
