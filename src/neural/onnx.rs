//! The subset of onnx.proto the engine reads (and, for the project's generated test models,
//! writes), decoded from the protobuf wire format by hand: no runtime, no code generator.
//!
//! Field numbers follow onnx.proto (IR version 3 and later). Unknown fields are skipped.

use super::NeuralError;
use super::tensor::{Tensor, Value};

/// `TensorProto.DataType` values the engine knows.
pub mod data_type {
    pub const FLOAT: i32 = 1;
    pub const UINT8: i32 = 2;
    pub const INT8: i32 = 3;
    pub const INT32: i32 = 6;
    pub const INT64: i32 = 7;
    pub const BOOL: i32 = 9;
    pub const FLOAT16: i32 = 10;
    pub const DOUBLE: i32 = 11;
}

/// `AttributeProto.AttributeType` values.
pub mod attribute_type {
    pub const FLOAT: i32 = 1;
    pub const INT: i32 = 2;
    pub const STRING: i32 = 3;
    pub const TENSOR: i32 = 4;
    pub const FLOATS: i32 = 6;
    pub const INTS: i32 = 7;
    pub const STRINGS: i32 = 8;
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelProto {
    /// field 1
    pub ir_version: i64,
    /// field 8: (domain, version); the default domain is ""
    pub opset_import: Vec<OperatorSetId>,
    /// field 2
    pub producer_name: String,
    /// field 7
    pub graph: GraphProto,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct OperatorSetId {
    /// field 1
    pub domain: String,
    /// field 2
    pub version: i64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct GraphProto {
    /// field 1
    pub node: Vec<NodeProto>,
    /// field 2
    pub name: String,
    /// field 5
    pub initializer: Vec<TensorProto>,
    /// field 11
    pub input: Vec<ValueInfoProto>,
    /// field 12
    pub output: Vec<ValueInfoProto>,
    /// field 13
    pub value_info: Vec<ValueInfoProto>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeProto {
    /// field 1
    pub input: Vec<String>,
    /// field 2
    pub output: Vec<String>,
    /// field 3
    pub name: String,
    /// field 4
    pub op_type: String,
    /// field 7
    pub domain: String,
    /// field 5
    pub attribute: Vec<AttributeProto>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttributeProto {
    /// field 1
    pub name: String,
    /// field 20
    pub r#type: i32,
    /// field 2
    pub f: f32,
    /// field 3
    pub i: i64,
    /// field 4
    pub s: Vec<u8>,
    /// field 5
    pub t: Option<TensorProto>,
    /// field 7 (packed or not)
    pub floats: Vec<f32>,
    /// field 8 (packed or not)
    pub ints: Vec<i64>,
    /// field 9
    pub strings: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorProto {
    /// field 1 (packed or not)
    pub dims: Vec<i64>,
    /// field 2
    pub data_type: i32,
    /// field 4 (packed or not)
    pub float_data: Vec<f32>,
    /// field 5 (packed or not): INT32, UINT8, INT8, BOOL, FLOAT16 bits
    pub int32_data: Vec<i32>,
    /// field 7 (packed or not)
    pub int64_data: Vec<i64>,
    /// field 8
    pub name: String,
    /// field 9: little-endian element bytes
    pub raw_data: Vec<u8>,
    /// field 10 (packed or not)
    pub double_data: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ValueInfoProto {
    /// field 1
    pub name: String,
    /// field 2: TypeProto.tensor_type (field 1) = { elem_type (1), shape (2) }
    pub elem_type: i32,
    /// TensorShapeProto.dim (field 1): dim_value (1) or dim_param (2); `None` when symbolic or
    /// absent. `shape` itself is `None` when the type carries no shape.
    pub shape: Option<Vec<Dim>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Dim {
    Value(i64),
    Param(String),
    Unknown,
}

// ---------------------------------------------------------------------------------------------
// Wire format: reading
// ---------------------------------------------------------------------------------------------

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// A bounds-checked cursor over one message's bytes. `base` is the message's offset in the whole
/// file, so errors give absolute byte positions; `path` says which message is being read.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    base: usize,
    path: &'a str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], base: usize, path: &'a str) -> Self {
        Reader {
            buf,
            pos: 0,
            base,
            path,
        }
    }

    fn at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn error(&self, what: &str) -> NeuralError {
        NeuralError::Parse(format!(
            "{what} at byte {} (in {})",
            self.base + self.pos,
            self.path
        ))
    }

    fn varint(&mut self) -> Result<u64, NeuralError> {
        let start = self.pos;
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.pos) else {
                self.pos = start;
                return Err(self.error("truncated varint"));
            };
            self.pos += 1;
            if i == 9 && b > 1 {
                self.pos = start;
                return Err(self.error("varint longer than 64 bits"));
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        self.pos = start;
        Err(self.error("varint longer than 10 bytes"))
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], NeuralError> {
        match self.buf.get(self.pos..self.pos + N) {
            Some(b) => {
                self.pos += N;
                Ok(b.try_into().expect("slice of N bytes"))
            }
            None => Err(self.error(&format!("truncated {}-byte fixed field", N))),
        }
    }

    /// A length-delimited payload; the length is checked against the bytes that remain before
    /// anything is allocated.
    fn bytes(&mut self) -> Result<(&'a [u8], usize), NeuralError> {
        let len = self.varint()?;
        let remaining = self.buf.len() - self.pos;
        if len > remaining as u64 {
            return Err(self.error(&format!(
                "length {len} runs past the end ({remaining} bytes remain)"
            )));
        }
        let start = self.pos;
        self.pos += len as usize;
        Ok((&self.buf[start..self.pos], self.base + start))
    }

    /// (field number, wire type).
    fn key(&mut self) -> Result<(u64, u8), NeuralError> {
        let key = self.varint()?;
        let field = key >> 3;
        let wire = (key & 7) as u8;
        if field == 0 {
            return Err(self.error("field number 0"));
        }
        Ok((field, wire))
    }

    fn skip(&mut self, wire: u8) -> Result<(), NeuralError> {
        match wire {
            VARINT => self.varint().map(|_| ()),
            FIXED64 => self.fixed::<8>().map(|_| ()),
            LEN => self.bytes().map(|_| ()),
            FIXED32 => self.fixed::<4>().map(|_| ()),
            other => Err(self.error(&format!("unsupported wire type {other}"))),
        }
    }

    fn expect(&self, wire: u8, want: u8, field: u64) -> Result<(), NeuralError> {
        if wire == want {
            Ok(())
        } else {
            Err(self.error(&format!(
                "field {field} has wire type {wire}, expected {want}"
            )))
        }
    }

    fn string(&mut self, wire: u8, field: u64) -> Result<String, NeuralError> {
        self.expect(wire, LEN, field)?;
        let (b, _) = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| self.error("string is not UTF-8"))
    }

    fn int64(&mut self, wire: u8, field: u64) -> Result<i64, NeuralError> {
        self.expect(wire, VARINT, field)?;
        Ok(self.varint()? as i64)
    }

    fn int32(&mut self, wire: u8, field: u64) -> Result<i32, NeuralError> {
        self.expect(wire, VARINT, field)?;
        // int32 is sign-extended to 64 bits on the wire; truncation is the protobuf rule
        Ok(self.varint()? as i64 as i32)
    }

    fn float(&mut self, wire: u8, field: u64) -> Result<f32, NeuralError> {
        self.expect(wire, FIXED32, field)?;
        Ok(f32::from_le_bytes(self.fixed::<4>()?))
    }

    /// Repeated varint field, packed (one LEN record) or not (one record per element). Grows
    /// `out` element by element, so memory is bounded by the input's size.
    fn repeated_varint(
        &mut self,
        wire: u8,
        field: u64,
        out: &mut Vec<i64>,
    ) -> Result<(), NeuralError> {
        match wire {
            VARINT => out.push(self.varint()? as i64),
            LEN => {
                let (b, base) = self.bytes()?;
                let mut packed = Reader::new(b, base, self.path);
                while !packed.at_end() {
                    out.push(packed.varint()? as i64);
                }
            }
            _ => self.expect(wire, VARINT, field)?,
        }
        Ok(())
    }

    fn repeated_fixed<const N: usize, T>(
        &mut self,
        wire: u8,
        field: u64,
        out: &mut Vec<T>,
        convert: fn([u8; N]) -> T,
    ) -> Result<(), NeuralError> {
        let single = if N == 4 { FIXED32 } else { FIXED64 };
        if wire == single {
            out.push(convert(self.fixed::<N>()?));
        } else if wire == LEN {
            let (b, base) = self.bytes()?;
            if b.len() % N != 0 {
                let r = Reader::new(b, base, self.path);
                return Err(r.error(&format!(
                    "packed field {field} of {} bytes is not a multiple of {N}",
                    b.len()
                )));
            }
            out.extend(
                b.chunks_exact(N)
                    .map(|c| convert(c.try_into().expect("chunk of N bytes"))),
            );
        } else {
            self.expect(wire, single, field)?;
        }
        Ok(())
    }

    /// A nested message: returns a reader over its payload with a longer path.
    fn message(&mut self, wire: u8, field: u64) -> Result<(&'a [u8], usize), NeuralError> {
        self.expect(wire, LEN, field)?;
        self.bytes()
    }
}

/// Decodes an ONNX model from protobuf bytes. Truncated or corrupt input gives
/// [`NeuralError::Parse`] naming the byte and the message; no length field is trusted before it
/// has been checked against the bytes that remain.
pub fn decode_model(bytes: &[u8]) -> Result<ModelProto, NeuralError> {
    if bytes.is_empty() {
        return Err(NeuralError::Parse("the file is empty".into()));
    }
    let mut r = Reader::new(bytes, 0, "ModelProto");
    let mut m = ModelProto::default();
    let mut have_graph = false;
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => m.ir_version = r.int64(wire, field)?,
            2 => m.producer_name = r.string(wire, field)?,
            7 => {
                let (b, base) = r.message(wire, field)?;
                m.graph = decode_graph(b, base, "ModelProto.graph")?;
                have_graph = true;
            }
            8 => {
                let (b, base) = r.message(wire, field)?;
                m.opset_import.push(decode_opset(b, base)?);
            }
            _ => r.skip(wire)?,
        }
    }
    if !have_graph {
        return Err(NeuralError::Parse(
            "the model has no graph (is this an ONNX file?)".into(),
        ));
    }
    Ok(m)
}

fn decode_opset(b: &[u8], base: usize) -> Result<OperatorSetId, NeuralError> {
    let mut r = Reader::new(b, base, "ModelProto.opset_import");
    let mut o = OperatorSetId::default();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => o.domain = r.string(wire, field)?,
            2 => o.version = r.int64(wire, field)?,
            _ => r.skip(wire)?,
        }
    }
    Ok(o)
}

fn decode_graph(b: &[u8], base: usize, path: &str) -> Result<GraphProto, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut g = GraphProto::default();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => {
                let (b, base) = r.message(wire, field)?;
                let p = format!("{path}.node[{}]", g.node.len());
                g.node.push(decode_node(b, base, &p)?);
            }
            2 => g.name = r.string(wire, field)?,
            5 => {
                let (b, base) = r.message(wire, field)?;
                let p = format!("{path}.initializer[{}]", g.initializer.len());
                g.initializer.push(decode_tensor(b, base, &p)?);
            }
            11..=13 => {
                let (b, base) = r.message(wire, field)?;
                let list = match field {
                    11 => &mut g.input,
                    12 => &mut g.output,
                    _ => &mut g.value_info,
                };
                let kind = ["input", "output", "value_info"][field as usize - 11];
                let p = format!("{path}.{kind}[{}]", list.len());
                list.push(decode_value_info(b, base, &p)?);
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(g)
}

fn decode_node(b: &[u8], base: usize, path: &str) -> Result<NodeProto, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut n = NodeProto::default();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => n.input.push(r.string(wire, field)?),
            2 => n.output.push(r.string(wire, field)?),
            3 => n.name = r.string(wire, field)?,
            4 => n.op_type = r.string(wire, field)?,
            7 => n.domain = r.string(wire, field)?,
            5 => {
                let (b, base) = r.message(wire, field)?;
                let p = format!("{path}.attribute[{}]", n.attribute.len());
                n.attribute.push(decode_attribute(b, base, &p)?);
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(n)
}

fn decode_attribute(b: &[u8], base: usize, path: &str) -> Result<AttributeProto, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut a = AttributeProto::default();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => a.name = r.string(wire, field)?,
            20 => a.r#type = r.int32(wire, field)?,
            2 => a.f = r.float(wire, field)?,
            3 => a.i = r.int64(wire, field)?,
            4 => {
                r.expect(wire, LEN, field)?;
                a.s = r.bytes()?.0.to_vec();
            }
            5 => {
                let (b, base) = r.message(wire, field)?;
                a.t = Some(decode_tensor(b, base, &format!("{path}.t"))?);
            }
            7 => r.repeated_fixed::<4, f32>(wire, field, &mut a.floats, f32::from_le_bytes)?,
            8 => r.repeated_varint(wire, field, &mut a.ints)?,
            9 => {
                r.expect(wire, LEN, field)?;
                a.strings.push(r.bytes()?.0.to_vec());
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(a)
}

fn decode_tensor(b: &[u8], base: usize, path: &str) -> Result<TensorProto, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut t = TensorProto::default();
    let mut int32 = Vec::new();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => r.repeated_varint(wire, field, &mut t.dims)?,
            2 => t.data_type = r.int32(wire, field)?,
            4 => r.repeated_fixed::<4, f32>(wire, field, &mut t.float_data, f32::from_le_bytes)?,
            5 => r.repeated_varint(wire, field, &mut int32)?,
            7 => r.repeated_varint(wire, field, &mut t.int64_data)?,
            8 => t.name = r.string(wire, field)?,
            9 => {
                r.expect(wire, LEN, field)?;
                t.raw_data = r.bytes()?.0.to_vec();
            }
            10 => {
                r.repeated_fixed::<8, f64>(wire, field, &mut t.double_data, f64::from_le_bytes)?
            }
            14 => {
                if r.int32(wire, field)? == 1 {
                    return Err(NeuralError::Unsupported(format!(
                        "tensor '{}' keeps its data in an external file (in {path}); the engine \
                         reads self-contained models only",
                        t.name
                    )));
                }
            }
            _ => r.skip(wire)?,
        }
    }
    t.int32_data = int32.into_iter().map(|v| v as i32).collect();
    Ok(t)
}

fn decode_value_info(b: &[u8], base: usize, path: &str) -> Result<ValueInfoProto, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut v = ValueInfoProto::default();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        match field {
            1 => v.name = r.string(wire, field)?,
            2 => {
                // TypeProto: only tensor_type (1) matters
                let (b, base) = r.message(wire, field)?;
                let mut tr = Reader::new(b, base, path);
                while !tr.at_end() {
                    let (field, wire) = tr.key()?;
                    if field != 1 {
                        tr.skip(wire)?;
                        continue;
                    }
                    let (b, base) = tr.message(wire, field)?;
                    let mut tt = Reader::new(b, base, path);
                    while !tt.at_end() {
                        let (field, wire) = tt.key()?;
                        match field {
                            1 => v.elem_type = tt.int32(wire, field)?,
                            2 => {
                                let (b, base) = tt.message(wire, field)?;
                                v.shape = Some(decode_shape(b, base, path)?);
                            }
                            _ => tt.skip(wire)?,
                        }
                    }
                }
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(v)
}

fn decode_shape(b: &[u8], base: usize, path: &str) -> Result<Vec<Dim>, NeuralError> {
    let mut r = Reader::new(b, base, path);
    let mut dims = Vec::new();
    while !r.at_end() {
        let (field, wire) = r.key()?;
        if field != 1 {
            r.skip(wire)?;
            continue;
        }
        let (b, base) = r.message(wire, field)?;
        let mut dr = Reader::new(b, base, path);
        let mut dim = Dim::Unknown;
        while !dr.at_end() {
            let (field, wire) = dr.key()?;
            match field {
                1 => dim = Dim::Value(dr.int64(wire, field)?),
                2 => dim = Dim::Param(dr.string(wire, field)?),
                _ => dr.skip(wire)?,
            }
        }
        dims.push(dim);
    }
    Ok(dims)
}

// ---------------------------------------------------------------------------------------------
// Wire format: writing (the project's generated models)
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Writer {
    out: Vec<u8>,
}

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.out.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.out.push(v as u8);
    }
    fn key(&mut self, field: u64, wire: u8) {
        self.varint((field << 3) | u64::from(wire));
    }
    fn int64(&mut self, field: u64, v: i64) {
        if v != 0 {
            self.key(field, VARINT);
            self.varint(v as u64);
        }
    }
    fn bytes(&mut self, field: u64, b: &[u8]) {
        self.key(field, LEN);
        self.varint(b.len() as u64);
        self.out.extend_from_slice(b);
    }
    fn string(&mut self, field: u64, s: &str) {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
    }
    fn message(&mut self, field: u64, m: Writer) {
        self.bytes(field, &m.out);
    }
    fn packed_varints(&mut self, field: u64, v: impl IntoIterator<Item = i64>) {
        let mut p = Writer::default();
        for x in v {
            p.varint(x as u64);
        }
        if !p.out.is_empty() {
            self.bytes(field, &p.out);
        }
    }
    fn packed_f32(&mut self, field: u64, v: &[f32]) {
        if !v.is_empty() {
            let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.bytes(field, &b);
        }
    }
}

/// Encodes a model in the protobuf wire format (packed repeated fields, default values
/// omitted), readable by [`decode_model`] and by other ONNX runtimes.
pub fn encode_model(model: &ModelProto) -> Vec<u8> {
    let mut w = Writer::default();
    w.int64(1, model.ir_version);
    w.string(2, &model.producer_name);
    w.message(7, encode_graph(&model.graph));
    for o in &model.opset_import {
        let mut ow = Writer::default();
        ow.string(1, &o.domain);
        ow.int64(2, o.version);
        w.message(8, ow);
    }
    w.out
}

fn encode_graph(g: &GraphProto) -> Writer {
    let mut w = Writer::default();
    for n in &g.node {
        let mut nw = Writer::default();
        for i in &n.input {
            nw.bytes(1, i.as_bytes()); // empty names are meaningful (omitted optional inputs)
        }
        for o in &n.output {
            nw.bytes(2, o.as_bytes());
        }
        nw.string(3, &n.name);
        nw.string(4, &n.op_type);
        nw.string(7, &n.domain);
        for a in &n.attribute {
            nw.message(5, encode_attribute(a));
        }
        w.message(1, nw);
    }
    w.string(2, &g.name);
    for t in &g.initializer {
        w.message(5, encode_tensor(t));
    }
    for (field, list) in [(11, &g.input), (12, &g.output), (13, &g.value_info)] {
        for v in list {
            w.message(field, encode_value_info(v));
        }
    }
    w
}

fn encode_attribute(a: &AttributeProto) -> Writer {
    let mut w = Writer::default();
    w.string(1, &a.name);
    w.int64(20, i64::from(a.r#type));
    if a.f != 0.0 || a.r#type == attribute_type::FLOAT {
        w.key(2, FIXED32);
        w.out.extend_from_slice(&a.f.to_le_bytes());
    }
    w.int64(3, a.i);
    if !a.s.is_empty() {
        w.bytes(4, &a.s);
    }
    if let Some(t) = &a.t {
        w.message(5, encode_tensor(t));
    }
    w.packed_f32(7, &a.floats);
    w.packed_varints(8, a.ints.iter().copied());
    for s in &a.strings {
        w.bytes(9, s);
    }
    w
}

fn encode_tensor(t: &TensorProto) -> Writer {
    let mut w = Writer::default();
    w.packed_varints(1, t.dims.iter().copied());
    w.int64(2, i64::from(t.data_type));
    w.packed_f32(4, &t.float_data);
    w.packed_varints(5, t.int32_data.iter().map(|&v| i64::from(v)));
    w.packed_varints(7, t.int64_data.iter().copied());
    w.string(8, &t.name);
    if !t.raw_data.is_empty() {
        w.bytes(9, &t.raw_data);
    }
    if !t.double_data.is_empty() {
        let b: Vec<u8> = t.double_data.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.bytes(10, &b);
    }
    w
}

fn encode_value_info(v: &ValueInfoProto) -> Writer {
    let mut tensor = Writer::default();
    tensor.int64(1, i64::from(v.elem_type));
    if let Some(dims) = &v.shape {
        let mut shape = Writer::default();
        for d in dims {
            let mut dw = Writer::default();
            match d {
                Dim::Value(x) => {
                    dw.key(1, VARINT);
                    dw.varint(*x as u64);
                }
                Dim::Param(p) => dw.bytes(2, p.as_bytes()),
                Dim::Unknown => {}
            }
            shape.message(1, dw);
        }
        tensor.message(2, shape);
    }
    let mut ty = Writer::default();
    ty.message(1, tensor);
    let mut w = Writer::default();
    w.string(1, &v.name);
    w.message(2, ty);
    w
}

// ---------------------------------------------------------------------------------------------
// Tensors to values
// ---------------------------------------------------------------------------------------------

/// Bytes per element of a data type, `None` when the engine does not read the type.
pub fn element_bytes(data_type: i32) -> Option<u64> {
    use data_type::*;
    match data_type {
        FLOAT | INT32 => Some(4),
        INT64 | DOUBLE => Some(8),
        FLOAT16 => Some(2),
        UINT8 | INT8 | BOOL => Some(1),
        _ => None,
    }
}

/// IEEE half to single precision (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exp = u32::from((bits >> 10) & 0x1f);
    let mant = u32::from(bits & 0x3ff);
    let magnitude = match (exp, mant) {
        (0, 0) => 0,
        (0, m) => {
            // subnormal: m · 2^-24, exactly representable in f32
            let v = m as f32 * 2f32.powi(-24);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => 0xff << 23,
        (0x1f, m) => (0xff << 23) | (m << 13),
        (e, m) => ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(sign | magnitude)
}

impl TensorProto {
    /// The tensor's shape as `usize`, checked (no negative dimension).
    pub fn shape(&self) -> Result<Vec<usize>, NeuralError> {
        self.dims
            .iter()
            .map(|&d| {
                usize::try_from(d).map_err(|_| {
                    NeuralError::Graph(format!(
                        "tensor '{}' has a negative dimension in {:?}",
                        self.name, self.dims
                    ))
                })
            })
            .collect()
    }

    /// Number of elements, checked against overflow.
    pub fn element_count(&self) -> Result<u64, NeuralError> {
        self.shape()?
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| {
                NeuralError::Model(format!(
                    "tensor '{}' has dimensions {:?} whose product overflows",
                    self.name, self.dims
                ))
            })
    }

    /// The bytes the decoded tensor claims (dims × element size), from the header alone.
    pub fn declared_bytes(&self) -> Result<u64, NeuralError> {
        let size = element_bytes(self.data_type).unwrap_or(4);
        self.element_count()?
            .checked_mul(size)
            .ok_or_else(|| NeuralError::Model(format!("tensor '{}' is too large", self.name)))
    }

    /// Decodes the tensor's data: floating types become [`Value::Float`], integer and boolean
    /// types [`Value::Int`]. The data's length must match the product of `dims`.
    pub fn to_value(&self) -> Result<Value, NeuralError> {
        use data_type::*;
        let shape = self.shape()?;
        let count = self.element_count()?;
        let name = &self.name;
        let size = element_bytes(self.data_type).ok_or_else(|| {
            NeuralError::Unsupported(format!(
                "tensor '{name}' has data type {}, the engine reads float, float16, double, \
                 int64, int32, int8, uint8 and bool",
                self.data_type
            ))
        })?;
        let mismatch = |found: usize| {
            NeuralError::Graph(format!(
                "tensor '{name}' has {found} elements of data for dimensions {:?} ({count} \
                 elements)",
                self.dims
            ))
        };
        let raw = !self.raw_data.is_empty();
        if raw {
            let need = count.checked_mul(size);
            if need != Some(self.raw_data.len() as u64) {
                return Err(mismatch(self.raw_data.len() / size as usize));
            }
        }
        // from here `count` is bounded by data the file holds
        let count = count as usize;
        let check = |n: usize| if n == count { Ok(()) } else { Err(mismatch(n)) };
        let chunks = |n: usize| self.raw_data.chunks_exact(n);
        let value = match self.data_type {
            FLOAT => {
                let data: Vec<f32> = if raw {
                    chunks(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                } else {
                    check(self.float_data.len())?;
                    self.float_data.clone()
                };
                Value::Float(Tensor::new(shape, data))
            }
            FLOAT16 => {
                let data: Vec<f32> = if raw {
                    chunks(2)
                        .map(|c| f16_to_f32(u16::from_le_bytes(c.try_into().unwrap())))
                        .collect()
                } else {
                    check(self.int32_data.len())?;
                    self.int32_data
                        .iter()
                        .map(|&b| f16_to_f32(b as u16))
                        .collect()
                };
                Value::Float(Tensor::new(shape, data))
            }
            DOUBLE => {
                let data: Vec<f32> = if raw {
                    chunks(8)
                        .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                        .collect()
                } else {
                    check(self.double_data.len())?;
                    self.double_data.iter().map(|&v| v as f32).collect()
                };
                Value::Float(Tensor::new(shape, data))
            }
            INT64 => {
                let data: Vec<i64> = if raw {
                    chunks(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                } else {
                    check(self.int64_data.len())?;
                    self.int64_data.clone()
                };
                Value::Int(Tensor::new(shape, data))
            }
            INT32 => {
                let data: Vec<i64> = if raw {
                    chunks(4)
                        .map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap())))
                        .collect()
                } else {
                    check(self.int32_data.len())?;
                    self.int32_data.iter().map(|&v| i64::from(v)).collect()
                };
                Value::Int(Tensor::new(shape, data))
            }
            UINT8 | BOOL => {
                let data: Vec<i64> = if raw {
                    self.raw_data.iter().map(|&b| i64::from(b)).collect()
                } else {
                    check(self.int32_data.len())?;
                    self.int32_data
                        .iter()
                        .map(|&v| i64::from(v as u8))
                        .collect()
                };
                Value::Int(Tensor::new(shape, data))
            }
            INT8 => {
                let data: Vec<i64> = if raw {
                    self.raw_data.iter().map(|&b| i64::from(b as i8)).collect()
                } else {
                    check(self.int32_data.len())?;
                    self.int32_data
                        .iter()
                        .map(|&v| i64::from(v as i8))
                        .collect()
                };
                Value::Int(Tensor::new(shape, data))
            }
            _ => unreachable!("element_bytes accepted the type"),
        };
        Ok(value)
    }
}

// ---------------------------------------------------------------------------------------------
// Builders (tests and model generators)
// ---------------------------------------------------------------------------------------------

/// A default-domain node; its name is its first output's name.
pub fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        name: outputs
            .first()
            .map_or(op.to_string(), |o| format!("{op}_{o}")),
        op_type: op.to_string(),
        domain: String::new(),
        attribute: attrs,
    }
}

pub fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INT,
        i,
        ..Default::default()
    }
}

pub fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INTS,
        ints: ints.to_vec(),
        ..Default::default()
    }
}

pub fn attr_float(name: &str, f: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOAT,
        f,
        ..Default::default()
    }
}

pub fn attr_floats(name: &str, floats: &[f32]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOATS,
        floats: floats.to_vec(),
        ..Default::default()
    }
}

pub fn attr_string(name: &str, s: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::STRING,
        s: s.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub fn attr_tensor(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::TENSOR,
        t: Some(t),
        ..Default::default()
    }
}

/// A float tensor (stored as raw little-endian bytes, as exporters do).
pub fn float_tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: data_type::FLOAT,
        name: name.into(),
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

/// An int64 tensor (in `int64_data`).
pub fn int64_tensor(name: &str, dims: &[i64], data: &[i64]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: data_type::INT64,
        name: name.into(),
        int64_data: data.to_vec(),
        ..Default::default()
    }
}

/// A tensor value description; a negative dimension is written as a symbolic one (`dim_param`
/// "d<index>"), as exporters write a dynamic batch or size.
pub fn value_info(name: &str, elem_type: i32, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        elem_type,
        shape: Some(
            dims.iter()
                .enumerate()
                .map(|(i, &d)| {
                    if d < 0 {
                        Dim::Param(format!("d{i}"))
                    } else {
                        Dim::Value(d)
                    }
                })
                .collect(),
        ),
    }
}

/// A model around `graph` for the default domain at `opset`.
pub fn model(graph: GraphProto, opset: i64) -> ModelProto {
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetId {
            domain: String::new(),
            version: opset,
        }],
        producer_name: "toonflow".into(),
        graph,
    }
}

impl ModelProto {
    /// The default domain's opset (`ai.onnx`, written as "" or "ai.onnx").
    pub fn default_opset(&self) -> Option<i64> {
        self.opset_import
            .iter()
            .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map(|o| o.version)
    }
}

impl NodeProto {
    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.attribute.iter().find(|a| a.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ModelProto {
        let mut g = GraphProto {
            name: "sample".into(),
            ..Default::default()
        };
        g.input
            .push(value_info("x", data_type::FLOAT, &[1, -1, -1, 3]));
        g.output
            .push(value_info("y", data_type::FLOAT, &[1, 3, -1, -1]));
        g.initializer.push(float_tensor(
            "w",
            &[2, 3, 1, 1],
            &[0.5, -1.25, 3.0, 1e-8, -0.0, 7.5],
        ));
        g.initializer
            .push(int64_tensor("pads", &[8], &[0, 0, 1, 1, 0, 0, 0, -1]));
        g.node.push(node(
            "Transpose",
            &["x"],
            &["xt"],
            vec![attr_ints("perm", &[0, 3, 1, 2])],
        ));
        g.node.push(node(
            "Conv",
            &["xt", "w", ""],
            &["y"],
            vec![
                attr_ints("strides", &[2, 2]),
                attr_float("alpha", 0.2),
                attr_float("zero", 0.0),
                attr_string("mode", "reflect"),
                attr_floats("scales", &[1.0, -2.5]),
                attr_int("group", -3),
                attr_tensor("value", int64_tensor("c", &[], &[i64::MIN])),
            ],
        ));
        g.value_info.push(ValueInfoProto {
            name: "xt".into(),
            elem_type: data_type::FLOAT,
            shape: Some(vec![Dim::Value(1), Dim::Unknown, Dim::Param("h".into())]),
        });
        g.value_info.push(ValueInfoProto {
            name: "noshape".into(),
            elem_type: data_type::INT64,
            shape: None,
        });
        model(g, 15)
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let m = sample();
        let bytes = encode_model(&m);
        let back = decode_model(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.default_opset(), Some(15));
        assert_eq!(encode_model(&back), bytes);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = encode_model(&sample());
        for len in 0..bytes.len() {
            // a cut can land on a message boundary and still parse; it must never panic and a
            // cut inside a record must fail
            let r = decode_model(&bytes[..len]);
            if let Err(e) = &r {
                assert!(matches!(e, NeuralError::Parse(_)), "{e}");
            }
        }
        let e = decode_model(&bytes[..bytes.len() - 3]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("at byte") && msg.contains("ModelProto"),
            "{msg}"
        );
    }

    #[test]
    fn huge_length_fields_are_refused_before_allocating() {
        // graph field with a length of 2^62
        let mut bytes = vec![(7 << 3) | 2];
        let mut w = Writer::default();
        w.varint(1 << 62);
        bytes.extend(w.out);
        bytes.extend([0u8; 8]);
        let msg = decode_model(&bytes).unwrap_err().to_string();
        assert!(msg.contains("runs past the end"), "{msg}");
        // a varint that never ends
        let msg = decode_model(&[
            8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1,
        ])
        .unwrap_err()
        .to_string();
        assert!(msg.contains("varint"), "{msg}");
        // a wire type that does not exist
        let msg = decode_model(&[(3 << 3) | 7]).unwrap_err().to_string();
        assert!(msg.contains("wire type 7"), "{msg}");
        // a packed float field whose length is not a multiple of 4
        let msg = decode_tensor(&[(4 << 3) | 2, 3, 0, 0, 0], 0, "t")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not a multiple of 4"), "{msg}");
        // not protobuf at all
        assert!(decode_model(b"hello, this is not a model").is_err());
        assert!(decode_model(&[]).is_err());
    }

    #[test]
    fn corrupt_bytes_never_panic() {
        let bytes = encode_model(&sample());
        let mut seed = 0x2545_f491_u64;
        for _ in 0..2000 {
            let mut b = bytes.clone();
            for _ in 0..3 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (seed >> 33) as usize % b.len();
                b[i] = (seed >> 20) as u8;
            }
            let _ = decode_model(&b);
        }
    }

    #[test]
    fn unpacked_repeated_fields_and_unknown_fields() {
        // TensorProto with dims written unpacked, floats unpacked (fixed32), an unknown fixed64
        // and an unknown varint field
        let mut w = Writer::default();
        for d in [2u64, 1] {
            w.key(1, VARINT);
            w.varint(d);
        }
        w.key(2, VARINT);
        w.varint(1);
        for f in [1.5f32, -2.0] {
            w.key(4, FIXED32);
            w.out.extend_from_slice(&f.to_le_bytes());
        }
        w.key(99, FIXED64);
        w.out.extend_from_slice(&[1; 8]);
        w.key(100, VARINT);
        w.varint(12345);
        w.bytes(8, b"t");
        let t = decode_tensor(&w.out, 0, "t").unwrap();
        assert_eq!(t.dims, vec![2, 1]);
        assert_eq!(
            t.to_value().unwrap(),
            Value::Float(Tensor::new(vec![2, 1], vec![1.5, -2.0]))
        );
    }

    #[test]
    fn tensor_values_of_every_storage() {
        let f = float_tensor("f", &[2], &[1.0, -3.5]);
        assert_eq!(
            f.to_value().unwrap(),
            Value::Float(Tensor::new(vec![2], vec![1.0, -3.5]))
        );
        let f = TensorProto {
            dims: vec![3],
            data_type: data_type::FLOAT16,
            raw_data: [0x3c00u16, 0xc000, 0x0001]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            ..Default::default()
        };
        assert_eq!(
            f.to_value().unwrap(),
            Value::Float(Tensor::new(vec![3], vec![1.0, -2.0, 2f32.powi(-24)]))
        );
        let i = TensorProto {
            dims: vec![2],
            data_type: data_type::INT32,
            int32_data: vec![-7, 9],
            ..Default::default()
        };
        assert_eq!(
            i.to_value().unwrap(),
            Value::Int(Tensor::new(vec![2], vec![-7, 9]))
        );
        let i = TensorProto {
            dims: vec![],
            data_type: data_type::INT64,
            raw_data: (-5i64).to_le_bytes().to_vec(),
            ..Default::default()
        };
        assert_eq!(i.to_value().unwrap(), Value::Int(Tensor::scalar(-5)));
        assert_eq!(
            int64_tensor("s", &[1, 2], &[4, 5]).to_value().unwrap(),
            Value::Int(Tensor::new(vec![1, 2], vec![4, 5]))
        );
    }

    #[test]
    fn tensor_data_must_match_dims() {
        let bad = float_tensor("w", &[2, 2], &[1.0, 2.0, 3.0]);
        let msg = bad.to_value().unwrap_err().to_string();
        assert!(msg.contains("'w'") && msg.contains("[2, 2]"), "{msg}");
        let huge = TensorProto {
            name: "huge".into(),
            dims: vec![1 << 40, 1 << 40],
            data_type: data_type::FLOAT,
            ..Default::default()
        };
        assert!(huge.to_value().is_err());
        assert!(huge.declared_bytes().is_err() || huge.declared_bytes().unwrap() > 1 << 30);
        let neg = TensorProto {
            dims: vec![-1],
            data_type: data_type::FLOAT,
            ..Default::default()
        };
        assert!(neg.to_value().is_err());
        let strings = TensorProto {
            dims: vec![1],
            data_type: 8,
            ..Default::default()
        };
        assert!(matches!(
            strings.to_value(),
            Err(NeuralError::Unsupported(_))
        ));
    }

    #[test]
    fn f16_conversion_is_exact() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
        assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }
}
