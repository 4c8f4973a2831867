//! Every CPU reference operator (and its main attribute variants) against tract-onnx, an
//! independent ONNX runtime: each case is a one-node model with fixed-seed random inputs,
//! run by `ops::run_node` and by tract; the worst absolute difference must be ≤ 1e-4 and is
//! printed per case (`cargo test --release --test neural_ops -- --nocapture`).
//!
//! Where tract lacks an operator or a mode (Upsample; opset-10 nearest rounding at
//! non-integer source coordinates), the case compares against values computed by hand from
//! the ONNX specification instead, and says so.

use gsttoonflow::neural::onnx::{
    self, AttributeProto, GraphProto, NodeProto, ValueInfoProto, attr_float, attr_floats, attr_int,
    attr_ints, attr_string, attr_tensor, data_type,
};
use gsttoonflow::neural::ops::{self, conv, elementwise::Activation, run_node};
use gsttoonflow::neural::{NeuralError, Tensor as NTensor, Value as NValue};
use tract_onnx::prelude::{
    Framework, InferenceModelExt, IntoRunnable, Tensor as TractTensor, TractResult, tvec,
};

const TOLERANCE: f32 = 1e-4;

/// xorshift64*: fixed-seed inputs, the same on every machine.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * v
    }

    fn floats(&mut self, shape: &[usize], lo: f32, hi: f32) -> NValue {
        let n = shape.iter().product();
        NValue::Float(NTensor::new(
            shape.to_vec(),
            (0..n).map(|_| self.uniform(lo, hi)).collect(),
        ))
    }
}

fn ints(shape: &[usize], data: &[i64]) -> NValue {
    NValue::Int(NTensor::new(shape.to_vec(), data.to_vec()))
}

fn ints1(data: &[i64]) -> NValue {
    ints(&[data.len()], data)
}

fn floats1(data: &[f32]) -> NValue {
    NValue::Float(NTensor::new(vec![data.len()], data.to_vec()))
}

/// How a node input reaches the model: a graph input fed at run time, an initializer (a
/// constant, as weights and shape arguments are in real models), or omitted ("").
enum Input {
    Feed(NValue),
    Init(NValue),
    Omitted,
}

struct Case {
    label: String,
    op: &'static str,
    opset: i64,
    attrs: Vec<AttributeProto>,
    inputs: Vec<Input>,
    /// An equivalent node tract runs instead, where tract cannot run this one.
    tract_as: Option<Box<Case>>,
}

fn case(label: &str, op: &'static str, opset: i64, attrs: Vec<AttributeProto>) -> Case {
    Case {
        label: label.to_string(),
        op,
        opset,
        attrs,
        inputs: Vec::new(),
        tract_as: None,
    }
}

impl Case {
    fn feed(mut self, v: NValue) -> Self {
        self.inputs.push(Input::Feed(v));
        self
    }
    fn init(mut self, v: NValue) -> Self {
        self.inputs.push(Input::Init(v));
        self
    }
    fn omit(mut self) -> Self {
        self.inputs.push(Input::Omitted);
        self
    }
    fn tract_runs(mut self, equivalent: Case) -> Self {
        self.tract_as = Some(Box::new(equivalent));
        self
    }

    fn input_names(&self) -> Vec<String> {
        self.inputs
            .iter()
            .enumerate()
            .map(|(i, inp)| match inp {
                Input::Omitted => String::new(),
                _ => format!("in{i}"),
            })
            .collect()
    }

    fn node(&self) -> NodeProto {
        let names = self.input_names();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        onnx::node(self.op, &refs, &["out"], self.attrs.clone())
    }

    fn ours(&self) -> Result<NValue, NeuralError> {
        let values: Vec<Option<&NValue>> = self
            .inputs
            .iter()
            .map(|inp| match inp {
                Input::Feed(v) | Input::Init(v) => Some(v),
                Input::Omitted => None,
            })
            .collect();
        let mut out = run_node(&self.node(), &values, self.opset)?;
        Ok(out.remove(0))
    }

    fn tract(&self, out_type: i32) -> TractResult<NValue> {
        if let Some(other) = &self.tract_as {
            return other.tract(out_type);
        }
        let names = self.input_names();
        let mut graph = GraphProto {
            name: self.label.clone(),
            node: vec![self.node()],
            ..Default::default()
        };
        let mut feeds = tvec!();
        for (inp, name) in self.inputs.iter().zip(&names) {
            match inp {
                Input::Feed(v) => {
                    let (elem, dims) = elem_and_dims(v);
                    graph.input.push(onnx::value_info(name, elem, &dims));
                    feeds.push(to_tract(v)?.into());
                }
                Input::Init(v) => graph.initializer.push(to_proto(name, v)),
                Input::Omitted => {}
            }
        }
        graph.output.push(ValueInfoProto {
            name: "out".into(),
            elem_type: out_type,
            shape: None,
        });
        let bytes = onnx::encode_model(&onnx::model(graph, self.opset));
        let model = tract_onnx::onnx()
            .model_for_read(&mut &bytes[..])?
            .into_optimized()?
            .into_runnable()?;
        let out = model.run(feeds)?;
        from_tract(&out[0], out_type)
    }
}

fn elem_and_dims(v: &NValue) -> (i32, Vec<i64>) {
    let elem = match v {
        NValue::Float(_) => data_type::FLOAT,
        NValue::Int(_) => data_type::INT64,
    };
    (elem, v.shape().iter().map(|&d| d as i64).collect())
}

fn to_proto(name: &str, v: &NValue) -> onnx::TensorProto {
    let (_, dims) = elem_and_dims(v);
    match v {
        NValue::Float(t) => onnx::float_tensor(name, &dims, &t.data),
        NValue::Int(t) => onnx::int64_tensor(name, &dims, &t.data),
    }
}

fn to_tract(v: &NValue) -> TractResult<TractTensor> {
    match v {
        NValue::Float(t) => TractTensor::from_shape(&t.shape, &t.data),
        NValue::Int(t) => TractTensor::from_shape(&t.shape, &t.data),
    }
}

fn from_tract(t: &TractTensor, out_type: i32) -> TractResult<NValue> {
    let shape = t.shape().to_vec();
    Ok(if out_type == data_type::INT64 {
        let c = t.cast_to::<i64>()?;
        NValue::Int(NTensor::new(
            shape,
            c.to_plain_array_view::<i64>()?.iter().copied().collect(),
        ))
    } else {
        let c = t.cast_to::<f32>()?;
        NValue::Float(NTensor::new(
            shape,
            c.to_plain_array_view::<f32>()?.iter().copied().collect(),
        ))
    })
}

/// Worst absolute difference (NaN in both counts as equal; shapes must match).
fn worst_diff(a: &NValue, b: &NValue) -> Result<f32, String> {
    if a.shape() != b.shape() {
        return Err(format!("shapes differ: {:?} vs {:?}", a.shape(), b.shape()));
    }
    let pairs: Vec<(f32, f32)> = match (a, b) {
        (NValue::Float(x), NValue::Float(y)) => {
            x.data.iter().copied().zip(y.data.iter().copied()).collect()
        }
        (NValue::Int(x), NValue::Int(y)) => x
            .data
            .iter()
            .zip(&y.data)
            .map(|(&p, &q)| (p as f32, q as f32))
            .collect(),
        _ => return Err("types differ".into()),
    };
    Ok(pairs
        .iter()
        .map(|&(p, q)| {
            if p.is_nan() && q.is_nan() || p == q {
                0.0
            } else {
                (p - q).abs()
            }
        })
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        ))
}

/// Runs every case, prints the worst difference per case, and fails listing the cases over
/// tolerance or with errors.
fn run_all(family: &str, cases: Vec<Case>) {
    let mut failures = Vec::new();
    let mut worst_family = 0.0f32;
    for c in &cases {
        let ours = match c.ours() {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!("{}: ours failed: {e}", c.label));
                continue;
            }
        };
        let out_type = elem_and_dims(&ours).0;
        let theirs = match c.tract(out_type) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!("{}: tract failed: {e:?}", c.label));
                continue;
            }
        };
        match worst_diff(&ours, &theirs) {
            Ok(d) => {
                println!(
                    "{family:<12} {:<52} {:<18} worst |ours - tract| = {d:.2e}",
                    c.label,
                    format!("{:?}", ours.shape())
                );
                worst_family = worst_family.max(d);
                if d > TOLERANCE {
                    failures.push(format!("{}: worst difference {d:e}", c.label));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", c.label)),
        }
    }
    println!(
        "{family:<12} {} cases, worst {worst_family:.2e}",
        cases.len()
    );
    assert!(failures.is_empty(), "{family}:\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------

/// (label, input shape, weight shape, attributes, with bias)
type ConvSpec = (
    &'static str,
    [usize; 4],
    [usize; 4],
    Vec<AttributeProto>,
    bool,
);
/// (label, input shape, weight shape, attributes)
type TransposedSpec = (&'static str, [usize; 4], [usize; 4], Vec<AttributeProto>);

#[test]
fn conv_family_matches_tract() {
    let mut r = Rng::new(1);
    let mut cases = Vec::new();
    // (label, input, weight, attrs, bias)
    let convs: Vec<ConvSpec> = vec![
        (
            "3x3 pad 1",
            [1, 4, 17, 19],
            [6, 4, 3, 3],
            vec![attr_ints("pads", &[1, 1, 1, 1])],
            true,
        ),
        (
            "3x3 stride 2 pads 1,1,0,0",
            [1, 4, 16, 16],
            [8, 4, 3, 3],
            vec![
                attr_ints("strides", &[2, 2]),
                attr_ints("pads", &[1, 1, 0, 0]),
            ],
            true,
        ),
        (
            "3x3 dilation 2 pads 2",
            [2, 3, 13, 11],
            [5, 3, 3, 3],
            vec![
                attr_ints("dilations", &[2, 2]),
                attr_ints("pads", &[2, 2, 2, 2]),
            ],
            true,
        ),
        (
            "group 2",
            [1, 6, 10, 10],
            [4, 3, 3, 3],
            vec![attr_int("group", 2), attr_ints("pads", &[1, 1, 1, 1])],
            true,
        ),
        (
            "depthwise stride 2",
            [1, 8, 15, 15],
            [8, 1, 3, 3],
            vec![
                attr_int("group", 8),
                attr_ints("strides", &[2, 2]),
                attr_ints("pads", &[1, 1, 1, 1]),
            ],
            true,
        ),
        (
            "7x7 pad 3",
            [1, 3, 20, 20],
            [4, 3, 7, 7],
            vec![attr_ints("pads", &[3, 3, 3, 3])],
            true,
        ),
        ("1x1 no bias", [1, 16, 9, 9], [7, 16, 1, 1], vec![], false),
        (
            "kernel_shape attr, rect stride",
            [1, 2, 12, 9],
            [3, 2, 2, 3],
            vec![
                attr_ints("kernel_shape", &[2, 3]),
                attr_ints("strides", &[1, 2]),
            ],
            true,
        ),
        (
            "auto_pad SAME_UPPER stride 2",
            [1, 3, 11, 10],
            [4, 3, 4, 3],
            vec![
                attr_string("auto_pad", "SAME_UPPER"),
                attr_ints("strides", &[2, 2]),
            ],
            true,
        ),
        (
            "auto_pad SAME_LOWER stride 2",
            [1, 3, 11, 10],
            [4, 3, 4, 3],
            vec![
                attr_string("auto_pad", "SAME_LOWER"),
                attr_ints("strides", &[2, 2]),
            ],
            true,
        ),
        (
            "auto_pad VALID",
            [1, 3, 9, 8],
            [2, 3, 3, 3],
            vec![attr_string("auto_pad", "VALID")],
            true,
        ),
    ];
    for (label, xs, ws, attrs, bias) in convs {
        let mut c = case(&format!("Conv {label}"), "Conv", 13, attrs)
            .feed(r.floats(&xs, -1.0, 1.0))
            .init(r.floats(&ws, -0.5, 0.5));
        if bias {
            c = c.init(r.floats(&[ws[0]], -1.0, 1.0));
        }
        cases.push(c);
    }
    cases.push(
        case(
            "Conv 1-D stride 2",
            "Conv",
            13,
            vec![attr_ints("strides", &[2]), attr_ints("pads", &[1, 2])],
        )
        .feed(r.floats(&[1, 3, 21], -1.0, 1.0))
        .init(r.floats(&[4, 3, 5], -0.5, 0.5)),
    );
    let transposed: Vec<TransposedSpec> = vec![
        (
            "stride 2 k3 pads 1 output_padding 1",
            [1, 6, 8, 7],
            [6, 4, 3, 3],
            vec![
                attr_ints("strides", &[2, 2]),
                attr_ints("pads", &[1, 1, 1, 1]),
                attr_ints("output_padding", &[1, 1]),
            ],
        ),
        (
            "stride 2 k4 pads 1",
            [1, 4, 6, 6],
            [4, 3, 4, 4],
            vec![
                attr_ints("strides", &[2, 2]),
                attr_ints("pads", &[1, 1, 1, 1]),
            ],
        ),
        (
            "group 2 dilation 2 asymmetric pads",
            [1, 4, 5, 6],
            [4, 3, 3, 3],
            vec![
                attr_int("group", 2),
                attr_ints("dilations", &[2, 2]),
                attr_ints("pads", &[0, 1, 2, 0]),
            ],
        ),
        (
            "output_shape larger than full (extra at the end)",
            [1, 3, 5, 5],
            [3, 2, 3, 3],
            vec![
                attr_ints("strides", &[2, 2]),
                attr_ints("output_shape", &[12, 13]),
            ],
        ),
    ];
    for (label, xs, ws, attrs) in transposed {
        cases.push(
            case(
                &format!("ConvTranspose {label}"),
                "ConvTranspose",
                13,
                attrs,
            )
            .feed(r.floats(&xs, -1.0, 1.0))
            .init(r.floats(&ws, -0.5, 0.5))
            .init(r.floats(&[ws[1]], -1.0, 1.0)),
        );
    }
    // output_shape smaller than the full output: pads from the spec's total_padding (begin
    // gets the larger half when not SAME_UPPER); tract reads output_shape as output_padding
    // only, so it runs the same node with the explicit pads the spec derives.
    {
        let x = r.floats(&[1, 3, 5, 5], -1.0, 1.0);
        let w = r.floats(&[3, 2, 3, 3], -0.5, 0.5);
        cases.push(
            case(
                "ConvTranspose output_shape smaller (pads 1,1,0,0)",
                "ConvTranspose",
                13,
                vec![
                    attr_ints("strides", &[2, 2]),
                    attr_ints("output_shape", &[10, 10]),
                ],
            )
            .feed(x.clone())
            .init(w.clone())
            .tract_runs(
                case(
                    "",
                    "ConvTranspose",
                    13,
                    vec![
                        attr_ints("strides", &[2, 2]),
                        attr_ints("pads", &[1, 1, 0, 0]),
                    ],
                )
                .feed(x)
                .init(w),
            ),
        );
    }
    // The group-2 case needs a bias of m = 3·2 = 6: rebuild it.
    if let Some(c) = cases
        .iter_mut()
        .find(|c| c.label.contains("group 2 dilation"))
    {
        c.inputs[2] = Input::Init(r.floats(&[6], -1.0, 1.0));
    }
    run_all("conv", cases);
}

#[test]
fn pad_matches_tract() {
    let mut r = Rng::new(2);
    let cases = vec![
        case(
            "Pad reflect NHWC H/W (first AnimeGAN pad)",
            "Pad",
            13,
            vec![attr_string("mode", "reflect")],
        )
        .feed(r.floats(&[1, 12, 10, 3], -1.0, 1.0))
        .init(ints1(&[0, 3, 3, 0, 0, 3, 3, 0])),
        case(
            "Pad reflect asymmetric 1,1,0,0",
            "Pad",
            13,
            vec![attr_string("mode", "reflect")],
        )
        .feed(r.floats(&[1, 4, 9, 8], -1.0, 1.0))
        .init(ints1(&[0, 0, 1, 1, 0, 0, 0, 0])),
        case("Pad edge", "Pad", 13, vec![attr_string("mode", "edge")])
            .feed(r.floats(&[1, 2, 5, 6], -1.0, 1.0))
            .init(ints1(&[0, 0, 2, 0, 0, 0, 1, 3])),
        case("Pad constant value 0.5", "Pad", 13, vec![])
            .feed(r.floats(&[1, 2, 5, 6], -1.0, 1.0))
            .init(ints1(&[0, 1, 2, 0, 1, 0, 1, 3]))
            .init(NValue::Float(NTensor::scalar(0.5))),
        // tract panics on negative pads: the crop is compared with the equivalent Slice.
        {
            let x = r.floats(&[1, 2, 7, 6], -1.0, 1.0);
            case(
                "Pad constant negative (crop) vs tract Slice",
                "Pad",
                13,
                vec![],
            )
            .feed(x.clone())
            .init(ints1(&[0, 0, -1, -2, 0, 0, -2, -1]))
            .tract_runs(
                case("Slice", "Slice", 13, vec![])
                    .feed(x)
                    .init(ints1(&[1, 2]))
                    .init(ints1(&[5, 5]))
                    .init(ints1(&[2, 3])),
            )
        },
        case(
            "Pad opset 2 attribute form",
            "Pad",
            2,
            vec![
                attr_string("mode", "reflect"),
                attr_ints("pads", &[0, 0, 2, 1, 0, 0, 1, 2]),
            ],
        )
        .feed(r.floats(&[1, 3, 6, 5], -1.0, 1.0)),
        case(
            "Pad opset 2 constant value",
            "Pad",
            2,
            vec![
                attr_ints("pads", &[0, 0, 1, 1, 0, 0, 1, 1]),
                attr_float("value", -2.0),
            ],
        )
        .feed(r.floats(&[1, 3, 4, 5], -1.0, 1.0)),
        case(
            "Pad opset 18 axes input",
            "Pad",
            18,
            vec![attr_string("mode", "reflect")],
        )
        .feed(r.floats(&[1, 3, 6, 5], -1.0, 1.0))
        .init(ints1(&[1, 2, 0, 1]))
        .omit()
        .init(ints1(&[2, 3])),
    ];
    run_all("pad", cases);
}

#[test]
fn resize_matches_tract() {
    let mut r = Rng::new(3);
    let x = |r: &mut Rng| r.floats(&[1, 3, 7, 6], -1.0, 1.0);
    let resize13 = |label: &str, attrs: Vec<AttributeProto>| case(label, "Resize", 13, attrs);
    let lin = |coord: &str| {
        vec![
            attr_string("mode", "linear"),
            attr_string("coordinate_transformation_mode", coord),
        ]
    };
    let near = |coord: &str, nm: &str| {
        vec![
            attr_string("mode", "nearest"),
            attr_string("coordinate_transformation_mode", coord),
            attr_string("nearest_mode", nm),
        ]
    };
    let scales = |s: &[f32]| floats1(s);
    let cases = vec![
        resize13(
            "Resize linear asymmetric sizes 2x (AnimeGAN)",
            lin("asymmetric"),
        )
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[1, 3, 14, 12])),
        resize13("Resize linear half_pixel scales 2x", lin("half_pixel"))
            .feed(x(&mut r))
            .omit()
            .init(scales(&[1.0, 1.0, 2.0, 2.0])),
        resize13(
            "Resize linear align_corners sizes 11x9",
            lin("align_corners"),
        )
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[1, 3, 11, 9])),
        resize13(
            "Resize linear pytorch_half_pixel sizes 1x13",
            lin("pytorch_half_pixel"),
        )
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[1, 3, 1, 13])),
        resize13("Resize linear half_pixel downscale 0.5", lin("half_pixel"))
            .feed(r.floats(&[1, 2, 12, 10], -1.0, 1.0))
            .omit()
            .init(scales(&[1.0, 1.0, 0.5, 0.5])),
        resize13(
            "Resize nearest half_pixel round_prefer_floor 3x",
            near("half_pixel", "round_prefer_floor"),
        )
        .feed(x(&mut r))
        .omit()
        .init(scales(&[1.0, 1.0, 3.0, 3.0])),
        resize13(
            "Resize nearest asymmetric round_prefer_ceil 2.5x",
            near("asymmetric", "round_prefer_ceil"),
        )
        .feed(x(&mut r))
        .omit()
        .init(scales(&[1.0, 1.0, 2.5, 2.5])),
        resize13(
            "Resize nearest asymmetric floor sizes",
            near("asymmetric", "floor"),
        )
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[1, 3, 10, 15])),
        resize13(
            "Resize nearest align_corners ceil",
            near("align_corners", "ceil"),
        )
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[1, 3, 9, 8])),
        resize13(
            "Resize nearest tf_half_pixel_for_nn",
            near("tf_half_pixel_for_nn", "round_prefer_floor"),
        )
        .feed(x(&mut r))
        .omit()
        .init(scales(&[1.0, 1.0, 2.0, 2.0])),
        case(
            "Resize opset 11 (roi input)",
            "Resize",
            11,
            lin("half_pixel"),
        )
        .feed(x(&mut r))
        .init(floats1(&[]))
        .init(scales(&[1.0, 1.0, 2.0, 2.0])),
        case(
            "Resize opset 10 linear 2x",
            "Resize",
            10,
            vec![attr_string("mode", "linear")],
        )
        .feed(x(&mut r))
        .init(scales(&[1.0, 1.0, 2.0, 2.0])),
        case(
            "Resize opset 10 nearest 2x",
            "Resize",
            10,
            vec![attr_string("mode", "nearest")],
        )
        .feed(x(&mut r))
        .init(scales(&[1.0, 1.0, 2.0, 2.0])),
        case("Resize opset 18 axes [2,3] sizes", "Resize", 18, {
            let mut a = lin("asymmetric");
            a.push(attr_ints("axes", &[2, 3]));
            a
        })
        .feed(x(&mut r))
        .omit()
        .omit()
        .init(ints1(&[14, 12])),
    ];
    run_all("resize", cases);
}

/// tract has no Upsample, and runs opset-10 Resize nearest with round_prefer_floor where the
/// specification (and onnxruntime) truncate: these compare against the spec's own examples.
#[test]
fn upsample_and_resize10_nearest_match_the_spec_examples() {
    let x = NValue::Float(NTensor::new(vec![1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]));
    // Upsample-9 / Resize-10 "nearest" example: scales [1, 1, 2, 3].
    let want_nearest = vec![
        1.0, 1.0, 1.0, 2.0, 2.0, 2.0, //
        1.0, 1.0, 1.0, 2.0, 2.0, 2.0, //
        3.0, 3.0, 3.0, 4.0, 4.0, 4.0, //
        3.0, 3.0, 3.0, 4.0, 4.0, 4.0,
    ];
    let s = floats1(&[1.0, 1.0, 2.0, 3.0]);
    for (op, opset) in [("Upsample", 9), ("Resize", 10)] {
        let c = case(op, op, opset, vec![attr_string("mode", "nearest")])
            .feed(x.clone())
            .init(s.clone());
        let NValue::Float(y) = c.ours().unwrap() else {
            panic!()
        };
        assert_eq!(y.shape, vec![1, 1, 4, 6], "{op}");
        assert_eq!(y.data, want_nearest, "{op}");
        println!("spec-example {op:<10} opset {opset} nearest [1,1,2,3]: exact");
    }
    // Upsample-7: scales as an attribute; the "linear" example (asymmetric, edge held).
    let c = case(
        "Upsample-7",
        "Upsample",
        7,
        vec![
            attr_string("mode", "linear"),
            attr_floats("scales", &[1.0, 1.0, 2.0, 2.0]),
        ],
    )
    .feed(x.clone());
    let NValue::Float(y) = c.ours().unwrap() else {
        panic!()
    };
    let want = vec![
        1.0, 1.5, 2.0, 2.0, //
        2.0, 2.5, 3.0, 3.0, //
        3.0, 3.5, 4.0, 4.0, //
        3.0, 3.5, 4.0, 4.0,
    ];
    assert_eq!(y.data, want);
    println!("spec-example Upsample-7 linear [1,1,2,2]: exact");
}

/// tract has no `wrap` Pad (opset 19): compared with numpy's definition, out[i] =
/// x[(i − begin) mod n] on every axis.
#[test]
fn pad_wrap_matches_its_definition() {
    let mut r = Rng::new(10);
    let (h, w) = (5usize, 4usize);
    let x = r.floats(&[1, 2, h, w], -1.0, 1.0);
    let (b, e) = ([0i64, 0, 2, 5], [0i64, 0, 1, 3]);
    let pads: Vec<i64> = b.iter().chain(&e).copied().collect();
    let c = case("Pad wrap", "Pad", 19, vec![attr_string("mode", "wrap")])
        .feed(x.clone())
        .init(ints1(&pads));
    let (NValue::Float(y), NValue::Float(xt)) = (c.ours().unwrap(), &x) else {
        panic!()
    };
    let (oh, ow) = (h + 3, w + 8);
    assert_eq!(y.shape, vec![1, 2, oh, ow]);
    for ch in 0..2 {
        for i in 0..oh {
            for j in 0..ow {
                let si = (i as i64 - b[2]).rem_euclid(h as i64) as usize;
                let sj = (j as i64 - b[3]).rem_euclid(w as i64) as usize;
                assert_eq!(
                    y.data[(ch * oh + i) * ow + j],
                    xt.data[(ch * h + si) * w + sj]
                );
            }
        }
    }
    println!("definition   Pad wrap (opset 19) {:?}: exact", y.shape);
}

#[test]
fn elementwise_matches_tract() {
    let mut r = Rng::new(4);
    let s = [1, 4, 6, 5];
    let mut cases = Vec::new();
    for op in [
        "Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Exp", "Floor", "Ceil",
    ] {
        cases.push(case(op, op, 13, vec![]).feed(r.floats(&s, -3.0, 3.0)));
    }
    for op in ["Sqrt", "Log", "Reciprocal"] {
        cases.push(case(&format!("{op} (positive)"), op, 13, vec![]).feed(r.floats(&s, 0.1, 3.0)));
    }
    cases.push(
        case(
            "LeakyRelu alpha 0.2",
            "LeakyRelu",
            13,
            vec![attr_float("alpha", 0.2)],
        )
        .feed(r.floats(&s, -3.0, 3.0)),
    );
    cases.push(
        case("LeakyRelu default alpha", "LeakyRelu", 13, vec![]).feed(r.floats(&s, -3.0, 3.0)),
    );
    cases.push(
        case("PRelu slope [C,1,1]", "PRelu", 13, vec![])
            .feed(r.floats(&s, -3.0, 3.0))
            .init(r.floats(&[4, 1, 1], 0.0, 0.5)),
    );
    cases.push(
        case("PRelu slope scalar-like [1]", "PRelu", 13, vec![])
            .feed(r.floats(&s, -3.0, 3.0))
            .init(r.floats(&[1], 0.0, 0.5)),
    );
    cases.push(
        case(
            "Clip opset 6 attributes",
            "Clip",
            6,
            vec![attr_float("min", -0.5), attr_float("max", 0.7)],
        )
        .feed(r.floats(&s, -2.0, 2.0)),
    );
    cases.push(
        case("Clip opset 13 min and max inputs", "Clip", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .init(NValue::Float(NTensor::scalar(-0.3)))
            .init(NValue::Float(NTensor::scalar(0.4))),
    );
    cases.push(
        case("Clip opset 13 min only", "Clip", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .init(NValue::Float(NTensor::scalar(0.1))),
    );
    cases.push(
        case("Clip opset 13 max only", "Clip", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .omit()
            .init(NValue::Float(NTensor::scalar(0.1))),
    );
    let bshapes: [&[usize]; 5] = [&[1, 4, 6, 5], &[1, 4, 1, 1], &[5], &[], &[4, 6, 1]];
    for op in ["Add", "Sub", "Mul", "Div"] {
        for bs in bshapes {
            let b = if op == "Div" {
                r.floats(bs, 0.5, 2.0)
            } else {
                r.floats(bs, -2.0, 2.0)
            };
            cases.push(
                case(&format!("{op} broadcast {bs:?}"), op, 13, vec![])
                    .feed(r.floats(&s, -2.0, 2.0))
                    .feed(b),
            );
        }
    }
    cases.push(
        case("Add [1,C,1,1] + [N,C,H,W]", "Add", 13, vec![])
            .feed(r.floats(&[1, 4, 1, 1], -1.0, 1.0))
            .feed(r.floats(&s, -1.0, 1.0)),
    );
    cases.push(
        case("Pow positive base", "Pow", 13, vec![])
            .feed(r.floats(&s, 0.1, 2.0))
            .feed(r.floats(&[1, 4, 1, 1], -2.0, 2.0)),
    );
    cases.push(
        case("Pow exponent 2 scalar", "Pow", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .init(NValue::Float(NTensor::scalar(2.0))),
    );
    cases.push(
        case("Pow int exponent", "Pow", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .init(ints(&[], &[3])),
    );
    cases.push(
        case("Min of 3", "Min", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .feed(r.floats(&[1, 4, 1, 1], -2.0, 2.0))
            .feed(r.floats(&[5], -2.0, 2.0)),
    );
    cases.push(
        case("Max of 2", "Max", 13, vec![])
            .feed(r.floats(&s, -2.0, 2.0))
            .feed(r.floats(&[6, 5], -2.0, 2.0)),
    );
    for op in ["Add", "Sub", "Mul", "Div"] {
        cases.push(
            case(&format!("{op} int64 (shape arithmetic)"), op, 13, vec![])
                .init(ints1(&[1, 3, 64, 48]))
                .init(ints1(&[1, 1, 2, 2])),
        );
    }
    cases.push(
        case("Mul int64 broadcast scalar", "Mul", 13, vec![])
            .init(ints1(&[-7, 9, 64]))
            .init(ints(&[], &[2])),
    );
    cases.push(
        case("Div int64 negative truncates", "Div", 13, vec![])
            .init(ints1(&[-7, 7, 64]))
            .init(ints1(&[2, -2, 3])),
    );
    run_all("elementwise", cases);
}

#[test]
fn norm_family_matches_tract() {
    let mut r = Rng::new(5);
    let s = [2, 3, 9, 11];
    let cases = vec![
        case("GlobalAveragePool", "GlobalAveragePool", 13, vec![]).feed(r.floats(&s, -1.0, 3.0)),
        case(
            "ReduceMean axes [2,3] keepdims",
            "ReduceMean",
            13,
            vec![attr_ints("axes", &[2, 3])],
        )
        .feed(r.floats(&s, -1.0, 3.0)),
        case(
            "ReduceMean axes [1] keepdims 0",
            "ReduceMean",
            13,
            vec![attr_ints("axes", &[1]), attr_int("keepdims", 0)],
        )
        .feed(r.floats(&s, -1.0, 3.0)),
        case(
            "ReduceMean axes [-1,-3]",
            "ReduceMean",
            13,
            vec![attr_ints("axes", &[-1, -3])],
        )
        .feed(r.floats(&s, -1.0, 3.0)),
        case("ReduceMean all axes", "ReduceMean", 13, vec![]).feed(r.floats(&s, -1.0, 3.0)),
        case("ReduceMean opset 18 axes input", "ReduceMean", 18, vec![])
            .feed(r.floats(&s, -1.0, 3.0))
            .init(ints1(&[2, 3])),
        case(
            "ReduceSum opset 13 axes input",
            "ReduceSum",
            13,
            vec![attr_int("keepdims", 0)],
        )
        .feed(r.floats(&s, -1.0, 1.0))
        .init(ints1(&[0, 2])),
        case(
            "ReduceMax axes [3]",
            "ReduceMax",
            13,
            vec![attr_ints("axes", &[3])],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case(
            "ReduceMin axes [1,2]",
            "ReduceMin",
            13,
            vec![attr_ints("axes", &[1, 2])],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case(
            "InstanceNormalization eps 1e-3",
            "InstanceNormalization",
            13,
            vec![attr_float("epsilon", 1e-3)],
        )
        .feed(r.floats(&s, -1.0, 3.0))
        .init(r.floats(&[3], 0.5, 1.5))
        .init(r.floats(&[3], -0.5, 0.5)),
        case(
            "InstanceNormalization default eps",
            "InstanceNormalization",
            13,
            vec![],
        )
        .feed(r.floats(&[1, 4, 32, 32], 10.0, 10.5))
        .init(r.floats(&[4], 0.5, 1.5))
        .init(r.floats(&[4], -0.5, 0.5)),
        case(
            "BatchNormalization inference",
            "BatchNormalization",
            15,
            vec![attr_float("epsilon", 1e-3)],
        )
        .feed(r.floats(&s, -1.0, 3.0))
        .init(r.floats(&[3], 0.5, 1.5))
        .init(r.floats(&[3], -0.5, 0.5))
        .init(r.floats(&[3], -0.5, 0.5))
        .init(r.floats(&[3], 0.2, 2.0)),
        case(
            "BatchNormalization opset 9",
            "BatchNormalization",
            9,
            vec![],
        )
        .feed(r.floats(&[2, 3, 7], -1.0, 3.0))
        .init(r.floats(&[3], 0.5, 1.5))
        .init(r.floats(&[3], -0.5, 0.5))
        .init(r.floats(&[3], -0.5, 0.5))
        .init(r.floats(&[3], 0.2, 2.0)),
        case(
            "Softmax opset 13 axis -1 (spatial positions)",
            "Softmax",
            13,
            vec![],
        )
        .feed(r.floats(&[1, 8, 256], -4.0, 4.0)),
        case(
            "Softmax opset 13 axis 1",
            "Softmax",
            13,
            vec![attr_int("axis", 1)],
        )
        .feed(r.floats(&s, -4.0, 4.0)),
        case(
            "Softmax opset 11 axis 1 (2-D coercion)",
            "Softmax",
            11,
            vec![],
        )
        .feed(r.floats(&s, -4.0, 4.0)),
        case(
            "Softmax opset 11 axis 2",
            "Softmax",
            11,
            vec![attr_int("axis", 2)],
        )
        .feed(r.floats(&s, -4.0, 4.0)),
    ];
    run_all("norm", cases);
}

#[test]
fn matmul_family_matches_tract() {
    let mut r = Rng::new(6);
    let cases = vec![
        case("MatMul 2-D", "MatMul", 13, vec![])
            .feed(r.floats(&[7, 9], -1.0, 1.0))
            .feed(r.floats(&[9, 5], -1.0, 1.0)),
        case("MatMul batch broadcast", "MatMul", 13, vec![])
            .feed(r.floats(&[2, 1, 3, 4], -1.0, 1.0))
            .feed(r.floats(&[3, 4, 5], -1.0, 1.0)),
        case(
            "MatMul [1,C,HW] x [1,HW,C] (attention-like)",
            "MatMul",
            13,
            vec![],
        )
        .feed(r.floats(&[1, 8, 64], -1.0, 1.0))
        .feed(r.floats(&[1, 64, 8], -1.0, 1.0)),
        case("MatMul 1-D x 2-D", "MatMul", 13, vec![])
            .feed(r.floats(&[6], -1.0, 1.0))
            .feed(r.floats(&[6, 3], -1.0, 1.0)),
        case("MatMul 2-D x 1-D", "MatMul", 13, vec![])
            .feed(r.floats(&[4, 6], -1.0, 1.0))
            .feed(r.floats(&[6], -1.0, 1.0)),
        case("Gemm plain with C [N]", "Gemm", 13, vec![])
            .feed(r.floats(&[5, 7], -1.0, 1.0))
            .init(r.floats(&[7, 4], -1.0, 1.0))
            .init(r.floats(&[4], -1.0, 1.0)),
        case(
            "Gemm transA transB alpha beta",
            "Gemm",
            13,
            vec![
                attr_int("transA", 1),
                attr_int("transB", 1),
                attr_float("alpha", 0.7),
                attr_float("beta", -1.3),
            ],
        )
        .feed(r.floats(&[7, 5], -1.0, 1.0))
        .init(r.floats(&[4, 7], -1.0, 1.0))
        .init(r.floats(&[5, 4], -1.0, 1.0)),
        case("Gemm no C", "Gemm", 13, vec![attr_int("transB", 1)])
            .feed(r.floats(&[3, 8], -1.0, 1.0))
            .init(r.floats(&[6, 8], -1.0, 1.0)),
    ];
    run_all("matmul", cases);
}

#[test]
fn shape_family_matches_tract() {
    let mut r = Rng::new(7);
    let s = [1, 4, 6, 5];
    let cases = vec![
        case(
            "Concat axis 1 of 3",
            "Concat",
            13,
            vec![attr_int("axis", 1)],
        )
        .feed(r.floats(&[1, 2, 6, 5], -1.0, 1.0))
        .feed(r.floats(&s, -1.0, 1.0))
        .feed(r.floats(&[1, 1, 6, 5], -1.0, 1.0)),
        case("Concat axis -1", "Concat", 13, vec![attr_int("axis", -1)])
            .feed(r.floats(&[2, 3, 2], -1.0, 1.0))
            .feed(r.floats(&[2, 3, 4], -1.0, 1.0)),
        case(
            "Concat int64 sizes",
            "Concat",
            13,
            vec![attr_int("axis", 0)],
        )
        .init(ints1(&[1, 3]))
        .init(ints1(&[14, 12])),
        case(
            "Transpose NHWC->NCHW",
            "Transpose",
            13,
            vec![attr_ints("perm", &[0, 3, 1, 2])],
        )
        .feed(r.floats(&[1, 6, 5, 3], -1.0, 1.0)),
        case(
            "Transpose NCHW->NHWC",
            "Transpose",
            13,
            vec![attr_ints("perm", &[0, 2, 3, 1])],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case("Transpose default (reverse)", "Transpose", 13, vec![]).feed(r.floats(
            &[2, 3, 4],
            -1.0,
            1.0,
        )),
        case("Reshape 0 and -1", "Reshape", 13, vec![])
            .feed(r.floats(&s, -1.0, 1.0))
            .init(ints1(&[0, 0, -1])),
        case("Reshape explicit", "Reshape", 13, vec![])
            .feed(r.floats(&s, -1.0, 1.0))
            .init(ints1(&[2, 60])),
        case("Flatten axis 2", "Flatten", 13, vec![attr_int("axis", 2)])
            .feed(r.floats(&s, -1.0, 1.0)),
        case("Flatten axis 0", "Flatten", 13, vec![attr_int("axis", 0)])
            .feed(r.floats(&s, -1.0, 1.0)),
        case("Flatten axis -1", "Flatten", 13, vec![attr_int("axis", -1)])
            .feed(r.floats(&s, -1.0, 1.0)),
        case("Squeeze opset 13 axes input", "Squeeze", 13, vec![])
            .feed(r.floats(&[1, 3, 1, 4], -1.0, 1.0))
            .init(ints1(&[0, -2])),
        case(
            "Squeeze opset 11 axes attribute",
            "Squeeze",
            11,
            vec![attr_ints("axes", &[2])],
        )
        .feed(r.floats(&[1, 3, 1, 4], -1.0, 1.0)),
        case("Squeeze all ones", "Squeeze", 13, vec![]).feed(r.floats(&[1, 3, 1, 4], -1.0, 1.0)),
        case("Unsqueeze opset 13 [0,-1]", "Unsqueeze", 13, vec![])
            .feed(r.floats(&[3, 4], -1.0, 1.0))
            .init(ints1(&[0, -1])),
        case(
            "Unsqueeze opset 11 attribute",
            "Unsqueeze",
            11,
            vec![attr_ints("axes", &[1])],
        )
        .feed(r.floats(&[3, 4], -1.0, 1.0)),
        case("Unsqueeze int64 scalar", "Unsqueeze", 13, vec![])
            .init(ints(&[], &[64]))
            .init(ints1(&[0])),
        case("Identity", "Identity", 13, vec![]).feed(r.floats(&s, -1.0, 1.0)),
        case(
            "Constant float tensor",
            "Constant",
            13,
            vec![attr_tensor(
                "value",
                onnx::float_tensor("", &[2, 2], &[1.0, -2.0, 3.5, 0.25]),
            )],
        ),
        case(
            "Constant value_ints",
            "Constant",
            13,
            vec![attr_ints("value_ints", &[3, 5, -1])],
        ),
        case(
            "Constant value_float",
            "Constant",
            13,
            vec![attr_float("value_float", 2.5)],
        ),
        case(
            "ConstantOfShape float",
            "ConstantOfShape",
            13,
            vec![attr_tensor("value", onnx::float_tensor("", &[1], &[0.75]))],
        )
        .init(ints1(&[2, 3])),
        case("ConstantOfShape default", "ConstantOfShape", 13, vec![]).init(ints1(&[4])),
        case(
            "Cast float->int64 truncates",
            "Cast",
            13,
            vec![attr_int("to", data_type::INT64 as i64)],
        )
        .feed(r.floats(&s, -5.0, 5.0)),
        case(
            "Cast int64->float",
            "Cast",
            13,
            vec![attr_int("to", data_type::FLOAT as i64)],
        )
        .init(ints1(&[1, -3, 256])),
        case(
            "Cast float->float",
            "Cast",
            13,
            vec![attr_int("to", data_type::FLOAT as i64)],
        )
        .feed(r.floats(&s, -5.0, 5.0)),
        case("Shape", "Shape", 13, vec![]).feed(r.floats(&s, -1.0, 1.0)),
        case(
            "Shape opset 15 start 2",
            "Shape",
            15,
            vec![attr_int("start", 2)],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case(
            "Shape opset 15 start -3 end -1",
            "Shape",
            15,
            vec![attr_int("start", -3), attr_int("end", -1)],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case(
            "Gather int64 shape dim (AnimeGAN)",
            "Gather",
            13,
            vec![attr_int("axis", 0)],
        )
        .init(ints1(&[1, 3, 64, 48]))
        .init(ints(&[], &[2])),
        case("Gather int64 negative indices", "Gather", 13, vec![])
            .init(ints1(&[1, 3, 64, 48]))
            .init(ints1(&[-1, -2])),
        case(
            "Gather float axis 1, 2-D indices",
            "Gather",
            13,
            vec![attr_int("axis", 1)],
        )
        .feed(r.floats(&s, -1.0, 1.0))
        .init(ints(&[2, 2], &[3, 0, 1, 1])),
        case("Slice starts/ends", "Slice", 13, vec![])
            .feed(r.floats(&s, -1.0, 1.0))
            .init(ints1(&[1, 2]))
            .init(ints1(&[3, 5]))
            .init(ints1(&[1, 2])),
        case("Slice negative, clamped, steps", "Slice", 13, vec![])
            .feed(r.floats(&s, -1.0, 1.0))
            .init(ints1(&[-1, 0, -100]))
            .init(ints1(&[-100, i64::MAX, 100]))
            .init(ints1(&[2, 3, 1]))
            .init(ints1(&[-1, 2, 2])),
        case("Slice reverse whole axis", "Slice", 13, vec![])
            .feed(r.floats(&s, -1.0, 1.0))
            .init(ints1(&[i64::MAX]))
            .init(ints1(&[i64::MIN]))
            .init(ints1(&[1]))
            .init(ints1(&[-1])),
        case("Slice int64 shape [2:]", "Slice", 13, vec![])
            .init(ints1(&[1, 3, 64, 48]))
            .init(ints1(&[2]))
            .init(ints1(&[4])),
        case(
            "Slice opset 9 attributes",
            "Slice",
            9,
            vec![
                attr_ints("starts", &[1, 0]),
                attr_ints("ends", &[3, -1]),
                attr_ints("axes", &[1, 3]),
            ],
        )
        .feed(r.floats(&s, -1.0, 1.0)),
        case("Expand", "Expand", 13, vec![])
            .feed(r.floats(&[4, 1, 1], -1.0, 1.0))
            .init(ints1(&[2, 1, 3, 5])),
    ];
    run_all("shape", cases);
}

// ---------------------------------------------------------------------------------------------

/// A 256x256 convolution of the size AnimeGAN runs (32 → 32 channels, 3x3, pad 1) and a
/// stride-2 one: correct against tract, and timed (printed; 2 cores in CI).
#[test]
fn conv_256_matches_tract_and_is_timed() {
    let mut r = Rng::new(8);
    let x = r.floats(&[1, 32, 256, 256], -1.0, 1.0);
    let w = r.floats(&[32, 32, 3, 3], -0.2, 0.2);
    let b = r.floats(&[32], -0.1, 0.1);
    for (label, stride, pads) in [
        ("3x3 s1", 1, [1i64, 1, 1, 1]),
        ("3x3 s2 asym", 2, [1, 1, 0, 0]),
    ] {
        let c = case(
            &format!("Conv 256x256 32->32 {label}"),
            "Conv",
            13,
            vec![
                attr_ints("strides", &[stride, stride]),
                attr_ints("pads", &pads),
            ],
        )
        .feed(x.clone())
        .init(w.clone())
        .init(b.clone());
        let t0 = std::time::Instant::now();
        let ours = c.ours().unwrap();
        let ours_s = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let theirs = c.tract(data_type::FLOAT).unwrap();
        let tract_s = t1.elapsed().as_secs_f64();
        let d = worst_diff(&ours, &theirs).unwrap();
        let macs = ours.shape().iter().product::<usize>() * 32 * 9;
        println!(
            "timing {label}: ours {:.1} ms ({:.2} GMAC/s, {} threads), tract (load+optimise+run) {:.1} ms, worst diff {d:.2e}",
            ours_s * 1e3,
            macs as f64 / ours_s / 1e9,
            ops::thread_count(),
            tract_s * 1e3
        );
        assert!(d <= TOLERANCE, "{label}: {d}");
    }
    // The plain kernel with the fused LeakyRelu gives the node's output, activated.
    let (NValue::Float(xt), NValue::Float(wt), NValue::Float(bt)) = (&x, &w, &b) else {
        panic!()
    };
    let p = conv::Conv2dParams {
        pads: [1; 4],
        ..Default::default()
    };
    let fused = conv::conv2d(
        &xt.data,
        [1, 32, 256, 256],
        &wt.data,
        [32, 32, 3, 3],
        Some(&bt.data),
        &p,
        Activation::LeakyRelu(0.2),
    )
    .unwrap();
    let plain = conv::conv2d(
        &xt.data,
        [1, 32, 256, 256],
        &wt.data,
        [32, 32, 3, 3],
        Some(&bt.data),
        &p,
        Activation::None,
    )
    .unwrap();
    assert!(
        fused
            .data
            .iter()
            .zip(&plain.data)
            .all(|(f, p)| *f == Activation::LeakyRelu(0.2).apply(*p))
    );
}

/// Bad attributes and shapes are errors naming the node and operator, never panics.
#[test]
fn bad_nodes_are_errors_naming_node_and_operator() {
    let mut r = Rng::new(9);
    let bad = vec![
        case("conv channel mismatch", "Conv", 13, vec![])
            .feed(r.floats(&[1, 3, 8, 8], -1.0, 1.0))
            .init(r.floats(&[4, 2, 3, 3], -1.0, 1.0)),
        case(
            "conv stride 0",
            "Conv",
            13,
            vec![attr_ints("strides", &[0, 1])],
        )
        .feed(r.floats(&[1, 3, 8, 8], -1.0, 1.0))
        .init(r.floats(&[4, 3, 3, 3], -1.0, 1.0)),
        case("conv kernel larger than input", "Conv", 13, vec![])
            .feed(r.floats(&[1, 1, 2, 2], -1.0, 1.0))
            .init(r.floats(&[1, 1, 3, 3], -1.0, 1.0)),
        case("conv 3-D", "Conv", 13, vec![])
            .feed(r.floats(&[1, 1, 2, 2, 2], -1.0, 1.0))
            .init(r.floats(&[1, 1, 1, 1, 1], -1.0, 1.0)),
        case("conv missing weight", "Conv", 13, vec![]).feed(r.floats(&[1, 1, 2, 2], -1.0, 1.0)),
        case("add no broadcast", "Add", 13, vec![])
            .feed(r.floats(&[2, 3], -1.0, 1.0))
            .feed(r.floats(&[4], -1.0, 1.0)),
        case("add mixed types", "Add", 13, vec![])
            .feed(r.floats(&[2], -1.0, 1.0))
            .init(ints1(&[1, 2])),
        case("int division by zero", "Div", 13, vec![])
            .init(ints1(&[1]))
            .init(ints1(&[0])),
        case("pad mode", "Pad", 13, vec![attr_string("mode", "mirror")])
            .feed(r.floats(&[2, 2], -1.0, 1.0))
            .init(ints1(&[0, 0, 0, 0])),
        case("pad count", "Pad", 13, vec![])
            .feed(r.floats(&[2, 2], -1.0, 1.0))
            .init(ints1(&[1, 1])),
        case("reshape impossible", "Reshape", 13, vec![])
            .feed(r.floats(&[2, 3], -1.0, 1.0))
            .init(ints1(&[4, -1])),
        case(
            "resize cubic",
            "Resize",
            13,
            vec![attr_string("mode", "cubic")],
        )
        .feed(r.floats(&[1, 1, 2, 2], -1.0, 1.0))
        .omit()
        .init(floats1(&[1.0, 1.0, 2.0, 2.0])),
        case("resize no scales or sizes", "Resize", 13, vec![]).feed(r.floats(
            &[1, 1, 2, 2],
            -1.0,
            1.0,
        )),
        case("gather out of range", "Gather", 13, vec![])
            .init(ints1(&[1, 2]))
            .init(ints1(&[2])),
        case(
            "transpose bad perm",
            "Transpose",
            13,
            vec![attr_ints("perm", &[0, 0])],
        )
        .feed(r.floats(&[2, 2], -1.0, 1.0)),
        case("softmax axis", "Softmax", 13, vec![attr_int("axis", 5)]).feed(r.floats(
            &[2, 2],
            -1.0,
            1.0,
        )),
        case(
            "attribute of the wrong type",
            "LeakyRelu",
            13,
            vec![attr_int("alpha", 1)],
        )
        .feed(r.floats(&[2, 2], -1.0, 1.0)),
        case("matmul mismatch", "MatMul", 13, vec![])
            .feed(r.floats(&[2, 3], -1.0, 1.0))
            .feed(r.floats(&[2, 3], -1.0, 1.0)),
        case("squeeze non-1 axis", "Squeeze", 13, vec![])
            .feed(r.floats(&[2, 3], -1.0, 1.0))
            .init(ints1(&[0])),
        case(
            "instance norm scale size",
            "InstanceNormalization",
            13,
            vec![],
        )
        .feed(r.floats(&[1, 2, 3, 3], -1.0, 1.0))
        .init(r.floats(&[3], -1.0, 1.0))
        .init(r.floats(&[2], -1.0, 1.0)),
        case("unknown operator", "NonMaxSuppression", 13, vec![]).feed(r.floats(&[2], -1.0, 1.0)),
    ];
    for c in bad {
        let err = c.ours().expect_err(&c.label);
        let msg = err.to_string();
        let name = c.node().name;
        assert!(
            msg.contains(c.op) && msg.contains(&name),
            "{}: {msg}",
            c.label
        );
        println!("{:<32} -> {msg}", c.label);
    }
}

/// Every operator the engine lists is exercised above (against tract or the spec).
#[test]
fn every_supported_operator_is_covered() {
    let src = include_str!("neural_ops.rs");
    for op in ops::SUPPORTED_OPS {
        assert!(
            src.contains(&format!("\"{op}\"")),
            "{op} has no case in tests/neural_ops.rs"
        );
    }
}
