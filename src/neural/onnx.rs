//! The subset of onnx.proto the engine reads (and, for the project's generated test models,
//! writes), decoded from the protobuf wire format by hand: no runtime, no code generator.
//!
//! Field numbers follow onnx.proto (IR version 3 and later). Unknown fields are skipped.

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
