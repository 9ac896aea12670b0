//! Images in chat requests (`image_url` parts with data URLs) on the MLX engine and a synthetic
//! model with vision weights: the prompt is the renderer's media blocks with each pad expanded
//! into the image's feature rows, and the greedy tokens equal a direct engine prefill of that
//! prompt with the MLX vision encoder's rows. Prefix reuse tells images apart; an Anthropic
//! `image` block renders the same prompt; `n` = 2 reuses the held prompt with its images. Bad
//! image input gets a 400 naming the part.

use std::sync::Arc;

use mac_decoder::engine::StoreOptions;
use mac_decoder::server::AppState;
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};
use support::FakeEngine;

mod support;

struct Server {
    base: String,
}

async fn serve(state: AppState) -> Server {
    Server { base: format!("http://{}", support::serve(state).await) }
}

async fn post(s: &Server, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn image_bytes(w: u32, h: u32, seed: u32, format: image::ImageFormat) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7 + seed) as u8, (y * 13 + seed * 3) as u8, ((x ^ y) * 5 + seed) as u8]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, format).unwrap();
    out.into_inner()
}

fn data_url(mime: &str, bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url, "detail": "auto"}})
}

fn chat(content: Value, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true})
}

/// Bad image input: a 400 whose message says what was wrong (and, where it can, which part).
/// `vision`: the model has a vision tower (else bytes are not decoded at all).
async fn bad_requests(s: &Server, png: &[u8], vision: bool) {
    let text = json!({"type": "text", "text": "Look:"});
    let cases: Vec<(Value, &str)> = vec![
        (chat(json!([text, image_part("https://example.com/cat.png")]), 4), "data URL"),
        (chat(json!([text, image_part("data:image/png;base64,@@@not base64@@@")]), 4), "base64"),
        (
            chat(json!([text, image_part(&data_url("image/png", b"this is not an image at all"))]), 4),
            if vision { "messages[0].content[1]" } else { "no vision tower" },
        ),
        (chat(json!([text, image_part(&data_url("text/plain", png))]), 4), "not an image"),
        (chat(json!([text, image_part("data:image/png,rawbytes")]), 4), "base64"),
        (chat(json!([text, {"type": "image_url"}]), 4), "image_url"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [image_part(&data_url("image/png", png))]}], "max_tokens": 2}),
            "user messages only",
        ),
    ];
    for (body, needle) in cases {
        let (status, v) = post(s, &body).await;
        assert_eq!(status, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
    }
}

/// A model without a vision tower refuses images clearly (fake engine: no MLX needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_without_a_vision_tower_are_refused() {
    let (_dir, tok) = support::synth_tokenizer(1024, 3000);
    let s = serve(support::app_state(move || Ok(FakeEngine::new(1024, 3000, vec![1], 2, |_| vec![])), StoreOptions::default(), tok, "fake")).await;
    let png = image_bytes(30, 20, 1, image::ImageFormat::Png);
    let (status, v) = post(&s, &chat(json!([image_part(&data_url("image/png", &png))]), 4)).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("no vision tower"), "{v}");
    bad_requests(&s, &png, false).await;
}

#[cfg(feature = "mlx")]
mod mlx {
    use super::*;
    use k3_protocol::Checkpoint;
    use mac_decoder::chat::render::{image_prompt, render};
    use mac_decoder::chat::Json;
    use mac_decoder::decode::{Engine, GenerateParams};
    use mac_decoder::server::api;
    use mac_decoder::tokenizer::names;
    use mac_decoder::vision::{self, ImageFeatures, MlxVisionEncoder, NormEps};

    fn ids(v: &Value) -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    }

    async fn metric(s: &Server, name: &str) -> f64 {
        support::metric(&reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap(), name)
    }

    /// What the server should have sent to the engine, built from the parts independently:
    /// the request rendered with each image's media block, tokenized, pads expanded.
    fn expected_prompt(tok: &Tokenizer, body: &Value, features: &[ImageFeatures], pad: u32) -> Vec<u32> {
        let v = Json::parse(&body.to_string()).unwrap();
        let mut req = api::chat_request(&v, "tiny", 0).unwrap();
        req.render.image_prompts = Some(features.iter().map(|f| image_prompt(f.original_size.0 as u32, f.original_size.1 as u32)).collect());
        let ids = tok.encode_segments(&render(&req.messages, &req.render).unwrap()).unwrap();
        let counts: Vec<usize> = features.iter().map(|f| f.rows).collect();
        vision::expand_media_ids(&ids, pad, &counts).unwrap().ids
    }

    /// Prefill `prompt` with the images' rows directly through the engine, then greedy decode
    /// with the server's stop ids.
    fn direct(engine: &Engine, tok: &Tokenizer, prompt: &[u32], features: &[ImageFeatures], n: usize) -> Vec<u32> {
        let mut s = engine.new_session().unwrap();
        let embeds = vision::image_embeds(features);
        engine.prefill_local(&mut s, prompt, Some(&embeds)).unwrap();
        let mut params = GenerateParams::greedy(n);
        params.stop_tokens = [names::END_OF_MSG, names::EOS].iter().filter_map(|n| tok.special_id(n)).collect();
        engine.generate(&mut s, &params, |_| true).unwrap().tokens
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn image_requests_equal_a_direct_prefill_with_the_embeddings() {
        let dir = support::tiny_model(Some(21));
        let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
        let s = serve(support::mlx_state(dir.path())).await;

        // The references: the same checkpoint, engine and MLX vision encoder, used directly.
        let ck = Checkpoint::open(dir.path()).unwrap();
        let pad = ck.config().media_placeholder_token_id;
        let engine = Engine::load(dir.path()).unwrap();
        let enc = MlxVisionEncoder::load(&ck, NormEps::Bf16).unwrap();

        // One PNG between two text parts.
        let a = image_bytes(84, 50, 1, image::ImageFormat::Png);
        let fa = vision::encode_image_bytes(&enc, &a).unwrap();
        let body = chat(json!([{"type": "text", "text": "What is this?"}, image_part(&data_url("image/png", &a)), {"type": "text", "text": "Be brief."}]), 8);
        let (status, v) = post(&s, &body).await;
        assert_eq!(status, 200, "{v}");
        let prompt = ids(&v["prompt_token_ids"]);
        assert_eq!(prompt, expected_prompt(&tok, &body, std::slice::from_ref(&fa), pad));
        assert_eq!(prompt.iter().filter(|&&t| t == pad).count(), fa.rows);
        let tokens = ids(&v["choices"][0]["token_ids"]);
        assert!(!tokens.is_empty());
        assert_eq!(tokens, direct(&engine, &tok, &prompt, std::slice::from_ref(&fa), 8), "server = direct prefill with the image rows");
        assert_eq!(metric(&s, "k3_images_total").await, 1.0);

        // The same request again: continued from the prompt checkpoint, the image not re-encoded.
        let (_, v2) = post(&s, &body).await;
        assert_eq!(ids(&v2["choices"][0]["token_ids"]), tokens);
        assert_eq!(v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt.len() as u64));
        assert_eq!(metric(&s, "k3_images_total").await, 1.0);

        // The same content as an Anthropic Messages request (an `image` block with a base64
        // source): the same prompt ids and images, so the whole prompt is the held checkpoint.
        use base64::Engine as _;
        let messages = json!({"max_tokens": 8, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 20000},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64::engine::general_purpose::STANDARD.encode(&a)}},
                {"type": "text", "text": "Be brief."}]}]});
        let r = reqwest::Client::new().post(format!("{}/v1/messages", s.base)).json(&messages).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let m: Value = r.json().await.unwrap();
        assert_eq!(m["usage"]["cache_read_input_tokens"].as_u64(), Some(prompt.len() as u64), "{m}");
        assert_eq!(m["usage"]["input_tokens"].as_u64(), Some(0), "{m}");
        assert_eq!(m["usage"]["output_tokens"].as_u64(), Some(tokens.len() as u64), "{m}");
        assert_eq!(metric(&s, "k3_images_total").await, 1.0);

        // Another image of the same size has the same token ids but must not reuse that state.
        let b = image_bytes(84, 50, 77, image::ImageFormat::Png);
        let fb = vision::encode_image_bytes(&enc, &b).unwrap();
        let body_b = chat(json!([{"type": "text", "text": "What is this?"}, image_part(&data_url("image/png", &b)), {"type": "text", "text": "Be brief."}]), 8);
        let (_, v3) = post(&s, &body_b).await;
        assert_eq!(ids(&v3["prompt_token_ids"]), prompt, "same size, same ids");
        assert_eq!(v3["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(0));
        assert_eq!(ids(&v3["choices"][0]["token_ids"]), direct(&engine, &tok, &prompt, std::slice::from_ref(&fb), 8));
        assert_eq!(metric(&s, "k3_images_total").await, 2.0);
        // n = 2 of that request: both choices continue the held prompt (its images included),
        // greedy, so both are the same reply; the tower does not run again.
        let mut body_n = body_b.clone();
        body_n["n"] = json!(2);
        let (status, v5) = post(&s, &body_n).await;
        assert_eq!(status, 200, "{v5}");
        for c in v5["choices"].as_array().unwrap() {
            assert_eq!(ids(&c["token_ids"]), ids(&v3["choices"][0]["token_ids"]));
        }
        assert_eq!(v5["usage"]["completion_tokens"].as_u64(), Some(2 * ids(&v3["choices"][0]["token_ids"]).len() as u64));
        assert_eq!(metric(&s, "k3_images_total").await, 2.0);

        // Two images (a JPEG, then a WebP) in one message, the OpenAI responses-style part too.
        let c = image_bytes(40, 100, 5, image::ImageFormat::Jpeg);
        let d = image_bytes(60, 33, 9, image::ImageFormat::WebP);
        let (fc, fd) = (vision::encode_image_bytes(&enc, &c).unwrap(), vision::encode_image_bytes(&enc, &d).unwrap());
        let body2 = chat(
            json!([image_part(&data_url("image/jpeg", &c)), {"type": "text", "text": "and"}, {"type": "input_image", "image_url": data_url("image/webp", &d)}]),
            6,
        );
        let (status, v4) = post(&s, &body2).await;
        assert_eq!(status, 200, "{v4}");
        let prompt2 = ids(&v4["prompt_token_ids"]);
        let both = [fc, fd];
        assert_eq!(prompt2, expected_prompt(&tok, &body2, &both, pad));
        assert_eq!(ids(&v4["choices"][0]["token_ids"]), direct(&engine, &tok, &prompt2, &both, 6));

        bad_requests(&s, &a, true).await;
    }
}
