//! The vision tower and projector weights (spec §2.4), widened to f32 and checked against the
//! `vision_config` shapes. Both the CPU reference and the MLX tower start from these.

use k3_protocol::{Checkpoint, CheckpointError, VisionConfig};

/// One encoder block.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    pub norm0: Vec<f32>,
    /// `[3 · qkv, d]`, rows `[q | k | v]`.
    pub wqkv: Vec<f32>,
    /// `[d, qkv]`.
    pub wo: Vec<f32>,
    pub norm1: Vec<f32>,
    /// `[inter, d]`.
    pub fc0: Vec<f32>,
    /// `[d, inter]`.
    pub fc1: Vec<f32>,
}

/// All vision tensors, row-major f32.
#[derive(Debug, Clone)]
pub struct VisionWeights {
    pub cfg: VisionConfig,
    /// `[d, 3, p, p]`.
    pub patch_embed: Vec<f32>,
    /// `[pos_h, pos_w, d]`.
    pub pos_emb: Vec<f32>,
    pub blocks: Vec<BlockWeights>,
    pub final_norm: Vec<f32>,
    /// `[4d, 4d]`.
    pub proj0: Vec<f32>,
    /// `[text_hidden, 4d]`.
    pub proj2: Vec<f32>,
    pub post_norm: Vec<f32>,
}

impl VisionWeights {
    /// Reads every vision tensor from an opened checkpoint (BF16/F32 widened exactly).
    pub fn load(ck: &Checkpoint) -> Result<Self, CheckpointError> {
        let cfg = ck.config().vision_config.clone();
        let (d, p, q, f) = (cfg.vt_hidden_size, cfg.patch_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size);
        let m = cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1] * cfg.mm_hidden_size;
        let t = cfg.text_hidden_size;
        let mut blocks = Vec::with_capacity(cfg.vt_num_hidden_layers);
        for b in 0..cfg.vt_num_hidden_layers {
            let n = |s: &str| format!("vision_tower.encoder.blocks.{b}.{s}");
            blocks.push(BlockWeights {
                norm0: ck.f32(&n("norm0.weight"), &[d])?,
                wqkv: ck.f32(&n("wqkv.weight"), &[3 * q, d])?,
                wo: ck.f32(&n("wo.weight"), &[d, q])?,
                norm1: ck.f32(&n("norm1.weight"), &[d])?,
                fc0: ck.f32(&n("mlp.fc0.weight"), &[f, d])?,
                fc1: ck.f32(&n("mlp.fc1.weight"), &[d, f])?,
            });
        }
        Ok(VisionWeights {
            patch_embed: ck.f32("vision_tower.patch_embed.proj.weight", &[d, 3, p, p])?,
            pos_emb: ck.f32("vision_tower.patch_embed.pos_emb.weight", &[cfg.init_pos_emb_height, cfg.init_pos_emb_width, d])?,
            blocks,
            final_norm: ck.f32("vision_tower.encoder.final_layernorm.weight", &[d])?,
            proj0: ck.f32("mm_projector.proj.0.weight", &[m, m])?,
            proj2: ck.f32("mm_projector.proj.2.weight", &[t, m])?,
            post_norm: ck.f32("mm_projector.post_norm.weight", &[t])?,
            cfg,
        })
    }

    /// Random weights for a `vision_config` (the spec §6 recipe: N(0, 1/fan_in) matrices,
    /// U(0.5, 1.5) norm gains, N(0, 1) position table), rounded to BF16 like a checkpoint.
    /// For tests of configurations that have no checkpoint.
    pub fn synthetic(cfg: &VisionConfig, seed: u64) -> Self {
        use rand::{Rng, SeedableRng};
        use rand_distr::{Distribution, Normal};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        let mat = |rows: usize, cols: usize, rng: &mut rand::rngs::StdRng| -> Vec<f32> {
            let n = Normal::new(0.0f32, (1.0 / cols as f32).sqrt()).unwrap();
            (0..rows * cols).map(|_| bf16(n.sample(rng))).collect()
        };
        let gain = |n: usize, rng: &mut rand::rngs::StdRng| -> Vec<f32> { (0..n).map(|_| bf16(rng.gen_range(0.5..1.5))).collect() };
        let (d, p, q, f) = (cfg.vt_hidden_size, cfg.patch_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size);
        let m = cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1] * cfg.mm_hidden_size;
        let t = cfg.text_hidden_size;
        let patch_embed = mat(d, 3 * p * p, &mut rng);
        let std = Normal::new(0.0f32, 1.0).unwrap();
        let pos_emb = (0..cfg.init_pos_emb_height * cfg.init_pos_emb_width * d).map(|_| bf16(std.sample(&mut rng))).collect();
        let blocks = (0..cfg.vt_num_hidden_layers)
            .map(|_| BlockWeights {
                norm0: gain(d, &mut rng),
                wqkv: mat(3 * q, d, &mut rng),
                wo: mat(d, q, &mut rng),
                norm1: gain(d, &mut rng),
                fc0: mat(f, d, &mut rng),
                fc1: mat(d, f, &mut rng),
            })
            .collect();
        VisionWeights {
            patch_embed,
            pos_emb,
            blocks,
            final_norm: gain(d, &mut rng),
            proj0: mat(m, m, &mut rng),
            proj2: mat(t, m, &mut rng),
            post_norm: gain(t, &mut rng),
            cfg: cfg.clone(),
        }
    }
}
