//! ONNX models the project owns: fixed-seed random weights in the layer patterns of the
//! AnimeGANv3 generators (whose weights are non-commercial and never committed), plus broken
//! models for the error paths. Include with `#[path = "common/onnx_models.rs"] mod
//! onnx_models;`.
#![allow(dead_code)]

use gsttoonflow::neural::onnx::*;

/// A small fixed-seed generator (xorshift64*), so every run writes the same bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Builds a graph node by node, naming values and weights as it goes.
pub struct Builder {
    pub nodes: Vec<NodeProto>,
    pub inits: Vec<TensorProto>,
    rng: Rng,
    count: usize,
}

impl Builder {
    pub fn new(seed: u64) -> Self {
        Builder {
            nodes: Vec::new(),
            inits: Vec::new(),
            rng: Rng::new(seed),
            count: 0,
        }
    }

    pub fn name(&mut self, base: &str) -> String {
        self.count += 1;
        format!("{base}_{}", self.count)
    }

    pub fn op(&mut self, op: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> String {
        let out = self.name(&op.to_lowercase());
        self.nodes.push(node(op, inputs, &[&out], attrs));
        out
    }

    pub fn floats(&mut self, base: &str, dims: &[i64], data: &[f32]) -> String {
        let name = self.name(base);
        self.inits.push(float_tensor(&name, dims, data));
        name
    }

    pub fn ints(&mut self, base: &str, dims: &[i64], data: &[i64]) -> String {
        let name = self.name(base);
        self.inits.push(int64_tensor(&name, dims, data));
        name
    }

    /// Random weights with variance 1/fan_in (activations keep their scale through depth).
    pub fn random(&mut self, base: &str, dims: &[i64], fan_in: usize) -> String {
        let n: i64 = dims.iter().product();
        let scale = (3.0 / fan_in as f32).sqrt();
        let data: Vec<f32> = (0..n).map(|_| self.rng.uniform() * scale).collect();
        self.floats(base, dims, &data)
    }

    /// Reflect pad of an NCHW activation: [top, left, bottom, right].
    pub fn reflect_pad(&mut self, x: &str, tlbr: [i64; 4]) -> String {
        let [t, l, b, r] = tlbr;
        let pads = self.ints("pads", &[8], &[0, 0, t, l, 0, 0, b, r]);
        self.op("Pad", &[x, &pads], vec![attr_string("mode", "reflect")])
    }

    /// Conv with bias (AnimeGANv3 folds its batch norms into conv biases).
    pub fn conv(&mut self, x: &str, cin: usize, cout: usize, k: usize, stride: usize) -> String {
        let w = self.random(
            "w",
            &[cout as i64, cin as i64, k as i64, k as i64],
            cin * k * k,
        );
        let b = self.random("b", &[cout as i64], 4);
        self.op(
            "Conv",
            &[x, &w, &b],
            vec![
                attr_ints("kernel_shape", &[k as i64, k as i64]),
                attr_ints("strides", &[stride as i64, stride as i64]),
                attr_ints("dilations", &[1, 1]),
                attr_int("group", 1),
            ],
        )
    }

    /// Conv without bias.
    pub fn conv_nb(&mut self, x: &str, cin: usize, cout: usize, k: usize) -> String {
        let w = self.random(
            "w",
            &[cout as i64, cin as i64, k as i64, k as i64],
            cin * k * k,
        );
        self.op(
            "Conv",
            &[x, &w],
            vec![attr_ints("kernel_shape", &[k as i64, k as i64])],
        )
    }

    pub fn lrelu(&mut self, x: &str) -> String {
        self.op("LeakyRelu", &[x], vec![attr_float("alpha", 0.2)])
    }

    /// Reflect pad (asymmetric before stride 2, as AnimeGANv3 writes it) + conv + LeakyRelu.
    pub fn block(&mut self, x: &str, cin: usize, cout: usize, k: usize, stride: usize) -> String {
        let p = if stride == 2 {
            [1, 1, 0, 0] // stride 2: top/left only
        } else {
            let h = (k / 2) as i64;
            [h, h, h, h]
        };
        let padded = self.reflect_pad(x, p);
        let c = self.conv(&padded, cin, cout, k, stride);
        self.lrelu(&c)
    }

    /// `mean, var, sqrt(var + eps)` of an NCHW activation as AnimeGANv3 spells it:
    /// GlobalAveragePool, Sub, Mul (square), GlobalAveragePool, Add eps, Sqrt. Returns
    /// (mean, diff, std).
    pub fn moments(&mut self, x: &str) -> (String, String, String) {
        let mean = self.op("GlobalAveragePool", &[x], vec![]);
        let diff = self.op("Sub", &[x, &mean], vec![]);
        let sq = self.op("Mul", &[&diff, &diff], vec![]);
        let var = self.op("GlobalAveragePool", &[&sq], vec![]);
        let eps = self.floats("eps", &[1, 1, 1, 1], &[1e-5]);
        let ve = self.op("Add", &[&var, &eps], vec![]);
        let std = self.op("Sqrt", &[&ve], vec![]);
        (mean, diff, std)
    }

    /// The self-modulated normalization of AnimeGANv3: `a` normalized by its own statistics,
    /// re-scaled by the statistics of `b` (a 1x1 conv of `a`), with the Transposes to NHWC and
    /// back and the per-channel Reshapes the TensorFlow export writes.
    pub fn modulated_norm(&mut self, a: &str, c: usize) -> String {
        let (_, diff_a, std_a) = self.moments(a);
        let b = self.conv_nb(a, c, c, 1);
        let (mean_b, _, std_b) = self.moments(&b);
        let nhwc = self.ints("shape", &[4], &[1, 1, 1, c as i64]);
        let ra = self.op("Reshape", &[&std_a, &nhwc], vec![]);
        let rb = self.op("Reshape", &[&std_b, &nhwc], vec![]);
        let t = self.op(
            "Transpose",
            &[&diff_a],
            vec![attr_ints("perm", &[0, 2, 3, 1])],
        );
        let div = self.op("Div", &[&t, &ra], vec![]);
        let mul = self.op("Mul", &[&div, &rb], vec![]);
        let back = self.op("Transpose", &[&mul], vec![attr_ints("perm", &[0, 3, 1, 2])]);
        let add = self.op("Add", &[&back, &mean_b], vec![]);
        self.lrelu(&add)
    }

    /// Bilinear 2x Resize whose sizes come from a Shape subgraph (Shape → Slice/Gather → Cast
    /// → Mul 2 → Cast → Concat), asymmetric coordinates.
    pub fn resize2x(&mut self, x: &str) -> String {
        let shape = self.op("Shape", &[x], vec![]);
        let zero = self.ints("zero", &[1], &[0]);
        let two_i = self.ints("two", &[1], &[2]);
        let nc = self.op("Slice", &[&shape, &zero, &two_i], vec![]);
        let hw_idx = self.ints("hw_idx", &[2], &[2, 3]);
        let hw = self.op("Gather", &[&shape, &hw_idx], vec![attr_int("axis", 0)]);
        let hw32 = self.op("Cast", &[&hw], vec![attr_int("to", 6)]);
        let two = self.name("two32");
        self.inits.push(TensorProto {
            name: two.clone(),
            dims: vec![1],
            data_type: data_type::INT32,
            int32_data: vec![2],
            ..Default::default()
        });
        let hw2 = self.op("Mul", &[&hw32, &two], vec![]);
        let hw64 = self.op("Cast", &[&hw2], vec![attr_int("to", 7)]);
        let sizes = self.op("Concat", &[&nc, &hw64], vec![attr_int("axis", 0)]);
        self.op(
            "Resize",
            &[x, "", "", &sizes],
            vec![
                attr_string("mode", "linear"),
                attr_string("coordinate_transformation_mode", "asymmetric"),
                attr_string("nearest_mode", "floor"),
            ],
        )
    }

    /// Attention over all spatial positions: a 1x1 conv to one map, Softmax over the H·W
    /// positions, the activation re-weighted by it.
    pub fn spatial_softmax(&mut self, x: &str, c: usize) -> String {
        let logits = self.conv_nb(x, c, 1, 1);
        let flat_shape = self.ints("flat", &[3], &[1, 1, -1]);
        let flat = self.op("Reshape", &[&logits, &flat_shape], vec![]);
        let soft = self.op("Softmax", &[&flat], vec![attr_int("axis", -1)]);
        let shape = self.op("Shape", &[&logits], vec![]);
        let map = self.op("Reshape", &[&soft, &shape], vec![]);
        // scale by the position count so the weights are ~1: Shape → ReduceProd is not in the
        // subset, so multiply by a learned-looking constant and add the input back
        let k = self.floats("k", &[1], &[50.0]);
        let scaled = self.op("Mul", &[&map, &k], vec![]);
        let weighted = self.op("Mul", &[x, &scaled], vec![]);
        self.op("Add", &[x, &weighted], vec![])
    }

    pub fn finish(self, input: &str, output: &str, input_dims: &[i64], name: &str) -> ModelProto {
        let mut out_dims = input_dims.to_vec();
        for d in out_dims.iter_mut() {
            if *d != 1 && *d != 3 {
                *d = -1;
            }
        }
        model(
            GraphProto {
                name: name.into(),
                node: self.nodes,
                initializer: self.inits,
                input: vec![value_info(input, data_type::FLOAT, input_dims)],
                output: vec![value_info(output, data_type::FLOAT, &out_dims)],
                ..Default::default()
            },
            15,
        )
    }
}

/// NHWC input → reflect pad of H and W (before the Transpose, as AnimeGANv3) → NCHW → 7x7
/// conv. Returns the activation after the first block.
fn stem(b: &mut Builder, c: usize) -> String {
    let pads = b.ints("pads", &[8], &[0, 3, 3, 0, 0, 3, 3, 0]);
    let p = b.op(
        "Pad",
        &["input", &pads],
        vec![attr_string("mode", "reflect")],
    );
    let t = b.op("Transpose", &[&p], vec![attr_ints("perm", &[0, 3, 1, 2])]);
    let c0 = b.conv(&t, 3, c, 7, 1);
    b.lrelu(&c0)
}

/// 7x7 conv to RGB, tanh, back to NHWC.
fn head(b: &mut Builder, x: &str, c: usize) -> String {
    let p = b.reflect_pad(x, [3, 3, 3, 3]);
    let y = b.conv_nb(&p, c, 3, 7);
    let t = b.op("Tanh", &[&y], vec![]);
    b.op("Transpose", &[&t], vec![attr_ints("perm", &[0, 2, 3, 1])])
}

/// The tiny AnimeGANv3 pattern: 4 stride-2 convolutions (size multiple 16), residual 1x1
/// blocks at the bottom, 4 bilinear 2x upsamplings with skip connections, two self-modulated
/// normalizations before the output.
pub fn tiny_like() -> ModelProto {
    tiny_like_channels([4, 8, 8, 12, 16], true, "tiny_like")
}

/// [`tiny_like`] with channel counts `ch` per resolution level (full to 1/16), and with or
/// without a block after the full-resolution skip Add (the real tiny has none: the
/// normalization's convolution reads the sum). With 16 channels at full resolution and no such
/// block, as the real tiny, its full-resolution tensors are stored channels-last and the
/// convolution over the sum runs in bands.
pub fn tiny_like_channels(ch: [usize; 5], full_res_block: bool, name: &str) -> ModelProto {
    let mut b = Builder::new(0x7109);
    let mut x = stem(&mut b, ch[0]);
    let mut skips = vec![x.clone()];
    for i in 0..4 {
        x = b.block(&x, ch[i], ch[i + 1], 3, 2);
        x = b.block(&x, ch[i + 1], ch[i + 1], 3, 1);
        skips.push(x.clone());
    }
    // residual 1x1 blocks
    let r = b.block(&x, ch[4], 8, 1, 1);
    let r = b.conv_nb(&r, 8, ch[4], 1);
    let sum = b.op("Add", &[&r, &x], vec![]);
    x = b.lrelu(&sum);
    for i in (0..4).rev() {
        let up = b.resize2x(&x);
        let y = b.block(&up, ch[i + 1], ch[i], 3, 1);
        let s = b.op("Add", &[&y, &skips[i]], vec![]);
        x = if i > 0 || full_res_block {
            b.block(&s, ch[i], ch[i], 3, 1)
        } else {
            s
        };
    }
    let p = b.reflect_pad(&x, [1, 1, 1, 1]);
    let a = b.conv_nb(&p, ch[0], ch[0], 3);
    let n = b.modulated_norm(&a, ch[0]);
    let out = head(&mut b, &n, ch[0]);
    let mut m = b.finish("input", &out, &[1, -1, -1, 3], name);
    rename_output(&mut m, &out, "output");
    m
}

/// The Hayao/Shinkai AnimeGANv3 pattern: 3 stride-2 convolutions (size multiple 8), many
/// self-modulated normalizations, one Softmax over all H/8·W/8 positions, an
/// InstanceNormalization (not in AnimeGANv3; the engine supports it), 3 upsamplings.
pub fn hayao_like() -> ModelProto {
    hayao_like_channels([4, 8, 12, 16], "hayao_like")
}

/// [`hayao_like`] with channel counts `ch` per resolution level (full, 1/2, 1/4, 1/8): with
/// [32, 64, 128, 256] it is Hayao-class in work (≈ 300 GMAC at 1080p, the real Hayao_36 has
/// 236), for speed measurements.
pub fn hayao_like_channels(ch: [usize; 4], name: &str) -> ModelProto {
    let mut b = Builder::new(0x4a7a0);
    let mut x = stem(&mut b, ch[0]);
    let mut skips = vec![x.clone()];
    for i in 0..3 {
        x = b.block(&x, ch[i], ch[i + 1], 3, 2);
        let p = b.reflect_pad(&x, [1, 1, 1, 1]);
        let a = b.conv_nb(&p, ch[i + 1], ch[i + 1], 3);
        x = b.modulated_norm(&a, ch[i + 1]);
        skips.push(x.clone());
    }
    x = b.spatial_softmax(&x, ch[3]);
    for _ in 0..2 {
        let a = b.conv_nb(&x, ch[3], ch[3], 1);
        let n = b.modulated_norm(&a, ch[3]);
        let s = b.op("Add", &[&n, &x], vec![]);
        x = s;
    }
    let scale = b.random("in_scale", &[ch[3] as i64], 1);
    let bias = b.random("in_bias", &[ch[3] as i64], 4);
    let inorm = b.op(
        "InstanceNormalization",
        &[&x, &scale, &bias],
        vec![attr_float("epsilon", 1e-5)],
    );
    x = b.op("Relu", &[&inorm], vec![]);
    for i in (0..3).rev() {
        let up = b.resize2x(&x);
        let y = b.block(&up, ch[i + 1], ch[i], 3, 1);
        let s = b.op("Add", &[&y, &skips[i]], vec![]);
        let p = b.reflect_pad(&s, [1, 1, 1, 1]);
        let a = b.conv_nb(&p, ch[i], ch[i], 3);
        x = b.modulated_norm(&a, ch[i]);
    }
    let out = head(&mut b, &x, ch[0]);
    let mut m = b.finish("input", &out, &[1, -1, -1, 3], name);
    rename_output(&mut m, &out, "output");
    m
}

fn rename_output(m: &mut ModelProto, from: &str, to: &str) {
    for n in m.graph.node.iter_mut() {
        for o in n.output.iter_mut().filter(|o| *o == from) {
            *o = to.into();
        }
    }
    m.graph.output[0].name = to.into();
}

/// Broken models and the words their errors must contain.
pub fn bad_models() -> Vec<(&'static str, Vec<u8>, Vec<&'static str>)> {
    let small = |nodes: Vec<NodeProto>, inits: Vec<TensorProto>, dims: &[i64]| {
        encode_model(&model(
            GraphProto {
                name: "bad".into(),
                node: nodes,
                initializer: inits,
                input: vec![value_info("input", data_type::FLOAT, dims)],
                output: vec![value_info("output", data_type::FLOAT, dims)],
                ..Default::default()
            },
            15,
        ))
    };
    let tiny = encode_model(&tiny_like());
    vec![
        (
            "cycle",
            small(
                vec![
                    node("Add", &["input", "loop"], &["a"], vec![]),
                    node("Relu", &["a"], &["loop"], vec![]),
                    node("Tanh", &["a"], &["output"], vec![]),
                ],
                vec![],
                &[1, -1, -1, 3],
            ),
            vec!["cycle", "Add_a", "Relu_loop", "'cycle.onnx'"],
        ),
        (
            "missing-initializer",
            small(
                vec![node("Mul", &["input", "gain"], &["output"], vec![])],
                vec![],
                &[1, -1, -1, 3],
            ),
            vec![
                "'gain'",
                "Mul_output",
                "no node, initializer or input",
                "'missing-initializer.onnx'",
            ],
        ),
        (
            "unsupported-op",
            small(
                vec![node("MaxRoiPool", &["input"], &["output"], vec![])],
                vec![],
                &[1, -1, -1, 3],
            ),
            vec![
                "'MaxRoiPool'",
                "MaxRoiPool_output",
                "'unsupported-op.onnx'",
                "not implemented",
            ],
        ),
        (
            "one-channel",
            small(
                vec![node("Relu", &["input"], &["output"], vec![])],
                vec![],
                &[1, -1, -1, 1],
            ),
            vec!["3-channel", "[1, ?, ?, 1]", "'one-channel.onnx'"],
        ),
        (
            "truncated",
            tiny[..tiny.len() * 2 / 3].to_vec(),
            vec![
                "not a valid ONNX file",
                "runs past the end",
                "'truncated.onnx'",
            ],
        ),
        (
            "not-protobuf",
            b"GIF89a, a picture, not a network".to_vec(),
            vec!["not a valid ONNX file", "'not-protobuf.onnx'"],
        ),
        (
            "huge-weights",
            small(
                vec![node("Add", &["input", "w"], &["output"], vec![])],
                vec![TensorProto {
                    name: "w".into(),
                    dims: vec![1 << 18, 1 << 12],
                    data_type: data_type::FLOAT,
                    ..Default::default()
                }],
                &[1, -1, -1, 3],
            ),
            vec![
                "4294967296 bytes of weights",
                "1 GiB",
                "'huge-weights.onnx'",
            ],
        ),
    ]
}

/// An NCHW model over other operators: a stride-2 conv with explicit pads, BatchNormalization,
/// a nearest Resize with constant scales, a depthwise conv, a ConvTranspose back up, Clip,
/// Concat and a Sigmoid output. Size multiple 4.
pub fn nchw_model() -> ModelProto {
    let mut b = Builder::new(0x9c4);
    let w = b.random("w", &[8, 3, 3, 3], 27);
    let c = b.op(
        "Conv",
        &["input", &w],
        vec![
            attr_ints("strides", &[2, 2]),
            attr_ints("pads", &[1, 1, 1, 1]),
        ],
    );
    let scale = b.random("bn_scale", &[8], 1);
    let bias = b.random("bn_bias", &[8], 4);
    let mean = b.random("bn_mean", &[8], 16);
    let var = b.floats("bn_var", &[8], &[0.5, 1.0, 1.5, 2.0, 0.7, 0.9, 1.1, 1.3]);
    let bn = b.op(
        "BatchNormalization",
        &[&c, &scale, &bias, &mean, &var],
        vec![attr_float("epsilon", 1e-3)],
    );
    let r = b.op("Relu", &[&bn], vec![]);
    let dw = b.random("dw", &[8, 1, 3, 3], 9);
    let d = b.op(
        "Conv",
        &[&r, &dw],
        vec![
            attr_int("group", 8),
            attr_ints("strides", &[2, 2]),
            attr_ints("pads", &[1, 1, 1, 1]),
        ],
    );
    let scales = b.floats("scales", &[4], &[1.0, 1.0, 2.0, 2.0]);
    let up = b.op(
        "Resize",
        &[&d, "", &scales],
        vec![attr_string("mode", "nearest")],
    );
    let cat = b.op("Concat", &[&up, &r], vec![attr_int("axis", 1)]);
    let tw = b.random("tw", &[16, 3, 2, 2], 16);
    let t = b.op(
        "ConvTranspose",
        &[&cat, &tw],
        vec![attr_ints("strides", &[2, 2])],
    );
    let lo = b.floats("lo", &[], &[-2.0]);
    let hi = b.floats("hi", &[], &[2.0]);
    let cl = b.op("Clip", &[&t, &lo, &hi], vec![]);
    let out = b.op("Sigmoid", &[&cl], vec![]);
    let mut m = b.finish("input", &out, &[1, 3, -1, -1], "nchw_model");
    rename_output(&mut m, &out, "output");
    m
}
