//! The host↔kernel ABI written once: `kernel_struct!` declares a `#[repr(C)]` struct shared
//! with CUDA C kernels and, from the same field list, its C declaration. The C texts and the
//! shared constants ([`Define`]) are prepended to the kernel source at NVRTC compile time, so the
//! kernels never carry a hand-written copy.
//!
//! Pure Rust, no device: any engine with kernels (the classic pipeline, the neural stage) can
//! declare its blocks here. Byte views go through `bytemuck` (every such struct is `Pod`).

/// A Rust field type with a C spelling: `i32`, `u32`, `f32` and one-dimensional arrays of them.
pub trait CType: bytemuck::Pod {
    /// The C declaration of a field `name` of this type, without the `;`.
    fn c_declaration(name: &str) -> String;
}

/// A scalar the kernels share with the host.
pub trait CScalar: bytemuck::Pod {
    const C_NAME: &'static str;
}

macro_rules! c_scalars {
    ($($rust:ty => $c:literal),* $(,)?) => {$(
        impl CScalar for $rust {
            const C_NAME: &'static str = $c;
        }
        impl CType for $rust {
            fn c_declaration(name: &str) -> String {
                format!("{} {name}", $c)
            }
        }
    )*};
}

c_scalars!(
    i32 => "int",
    u32 => "unsigned int",
    f32 => "float",
    i64 => "long long",
    u64 => "unsigned long long",
    f64 => "double",
);

impl<T: CScalar, const N: usize> CType for [T; N]
where
    [T; N]: bytemuck::Pod,
{
    fn c_declaration(name: &str) -> String {
        format!("{} {name}[{N}]", T::C_NAME)
    }
}

/// Where a field sits, as the Rust compiler laid it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldLayout {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
    /// The C declaration, e.g. `float luma_spatial[25]`.
    pub c_declaration: String,
}

/// A struct declared with `kernel_struct!`: its C name and its fields in declaration order.
pub trait KernelStruct: bytemuck::Pod {
    const C_NAME: &'static str;
    fn fields() -> Vec<FieldLayout>;

    /// `typedef struct Name { ... } Name;`, valid C and CUDA C++.
    fn c_declaration() -> String {
        let mut s = format!("typedef struct {} {{\n", Self::C_NAME);
        for f in Self::fields() {
            s.push_str(&format!("    {};\n", f.c_declaration));
        }
        s.push_str(&format!("}} {};\n", Self::C_NAME));
        s
    }
}

/// Declares a struct shared with the kernels: emits the `#[repr(C)]` Rust struct (deriving
/// `Clone`, `Copy`, `bytemuck::Pod` and `bytemuck::Zeroable`, plus the derives given) and its
/// [`KernelStruct`] impl, from which the C declaration and the field offsets come.
///
/// `Pod` refuses padding at compile time, so the two sides cannot differ by an implicit gap;
/// field types are the [`CType`]s.
macro_rules! kernel_struct {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$field_meta:meta])*
                $field_vis:vis $field:ident : $ty:ty
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $(
                $(#[$field_meta])*
                $field_vis $field: $ty,
            )*
        }

        impl $crate::kernel_abi::KernelStruct for $name {
            const C_NAME: &'static str = stringify!($name);
            fn fields() -> Vec<$crate::kernel_abi::FieldLayout> {
                vec![$(
                    $crate::kernel_abi::FieldLayout {
                        name: stringify!($field),
                        offset: ::core::mem::offset_of!($name, $field),
                        size: ::core::mem::size_of::<$ty>(),
                        c_declaration:
                            <$ty as $crate::kernel_abi::CType>::c_declaration(stringify!($field)),
                    },
                )*]
            }
        }
    };
}
pub(crate) use kernel_struct;

/// A constant both sides use, emitted as `#define NAME value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Define {
    pub name: &'static str,
    pub value: DefineValue,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DefineValue {
    Int(i64),
    Float(f32),
}

impl Define {
    pub fn int(name: &'static str, value: impl Into<i64>) -> Self {
        Define {
            name,
            value: DefineValue::Int(value.into()),
        }
    }

    pub fn float(name: &'static str, value: f32) -> Self {
        Define {
            name,
            value: DefineValue::Float(value),
        }
    }

    /// The value as a C literal. A float is written in Rust's shortest round-trip form with an
    /// `f` suffix, so the C compiler reads back exactly the same `float`.
    pub fn c_value(&self) -> String {
        match self.value {
            DefineValue::Int(v) => v.to_string(),
            DefineValue::Float(v) => {
                assert!(
                    v.is_finite(),
                    "{}: a C literal needs a finite value",
                    self.name
                );
                format!("{v:?}f")
            }
        }
    }

    pub fn c_text(&self) -> String {
        format!("#define {} {}\n", self.name, self.c_value())
    }
}

/// The C text of `defines` then `structs` (each given by its declaration).
pub fn c_header(title: &str, defines: &[Define], structs: &[String]) -> String {
    let mut s = format!("// {title}\n// Generated from Rust by kernel_abi; do not edit.\n");
    for d in defines {
        s.push_str(&d.c_text());
    }
    for st in structs {
        s.push('\n');
        s.push_str(st);
    }
    s
}

/// A table of floats both sides use, as `__device__ const float NAME[N] = {...};`, each
/// value in Rust's shortest round-trip form with an `f` suffix (the C compiler reads back
/// exactly the same `float`).
pub fn c_float_table(name: &str, values: &[f32]) -> String {
    let items: Vec<String> = values
        .iter()
        .map(|v| {
            assert!(v.is_finite(), "{name}: a C literal needs a finite value");
            format!("{v:?}f")
        })
        .collect();
    format!(
        "__device__ const float {name}[{}] = {{{}}};\n",
        values.len(),
        items.join(", ")
    )
}

/// The layout of one struct as the host sees it, for [`c_compiler_check`].
#[derive(Debug, Clone)]
pub struct StructLayout {
    pub c_name: &'static str,
    pub size: usize,
    pub fields: Vec<FieldLayout>,
}

impl StructLayout {
    pub fn of<T: KernelStruct>() -> Self {
        StructLayout {
            c_name: T::C_NAME,
            size: std::mem::size_of::<T>(),
            fields: T::fields(),
        }
    }
}

/// What a C compiler made of a header.
#[derive(Debug)]
pub enum CCheck {
    /// No C compiler found (`$CC`, `cc`, `gcc`, `clang`).
    NoCompiler,
    /// Every size, offset and constant agreed.
    Agreed { compiler: String, checked: usize },
}

/// Compiles `header` with the host C compiler inside a program that prints `sizeof` and
/// `offsetof` of every field of `structs` and the value of every define, runs it, and compares
/// each figure with the Rust side. `Err` names every disagreement.
pub fn c_compiler_check(
    header: &str,
    structs: &[StructLayout],
    defines: &[Define],
) -> Result<CCheck, String> {
    let Some(compiler) = find_c_compiler() else {
        return Ok(CCheck::NoCompiler);
    };
    let mut program =
        String::from("#include <stddef.h>\n#include <stdio.h>\n#include <string.h>\n\n");
    program.push_str(header);
    program.push_str("\nint main(void)\n{\n");
    let mut expected = Vec::new();
    for st in structs {
        let t = st.c_name;
        program.push_str(&format!(
            "    printf(\"sizeof {t} %zu\\n\", sizeof({t}));\n"
        ));
        expected.push(format!("sizeof {t} {}", st.size));
        for f in &st.fields {
            let n = f.name;
            program.push_str(&format!(
                "    printf(\"offsetof {t}.{n} %zu\\n\", offsetof({t}, {n}));\n    \
                 printf(\"sizeof {t}.{n} %zu\\n\", sizeof((({t}*)0)->{n}));\n"
            ));
            expected.push(format!("offsetof {t}.{n} {}", f.offset));
            expected.push(format!("sizeof {t}.{n} {}", f.size));
        }
    }
    for d in defines {
        let n = d.name;
        match d.value {
            DefineValue::Int(v) => {
                program.push_str(&format!(
                    "    printf(\"define {n} %lld\\n\", (long long)({n}));\n"
                ));
                expected.push(format!("define {n} {v}"));
            }
            DefineValue::Float(v) => {
                // The bits of the float the C compiler made of the literal.
                program.push_str(&format!(
                    "    {{ float f = {n}; unsigned int u; memcpy(&u, &f, 4); \
                     printf(\"define {n} %u\\n\", u); }}\n"
                ));
                expected.push(format!("define {n} {}", v.to_bits()));
            }
        }
    }
    program.push_str("    return 0;\n}\n");

    let dir = std::env::temp_dir().join(format!(
        "toonflow-abi-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = (|| {
        let src = dir.join("abi.c");
        let exe = dir.join("abi");
        std::fs::write(&src, &program).map_err(|e| format!("{}: {e}", src.display()))?;
        let out = std::process::Command::new(&compiler)
            .args(["-std=c11", "-Wall", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .map_err(|e| format!("running {compiler}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{compiler} could not compile the generated header:\n{}\n{program}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let run = std::process::Command::new(&exe)
            .output()
            .map_err(|e| format!("running {}: {e}", exe.display()))?;
        if !run.status.success() {
            return Err(format!("{} failed: {:?}", exe.display(), run.status));
        }
        let got: Vec<String> = String::from_utf8_lossy(&run.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        let mismatches: Vec<String> = expected
            .iter()
            .zip(got.iter().map(Some).chain(std::iter::repeat(None)))
            .filter(|(e, g)| Some(*e) != *g)
            .map(|(e, g)| format!("Rust says `{e}`, C says `{}`", g.map_or("", |s| s)))
            .collect();
        if !mismatches.is_empty() || got.len() != expected.len() {
            return Err(format!(
                "the C side disagrees with the Rust side:\n{}",
                mismatches.join("\n")
            ));
        }
        Ok(CCheck::Agreed {
            compiler: compiler.clone(),
            checked: expected.len(),
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn find_c_compiler() -> Option<String> {
    let candidates = std::env::var("CC")
        .ok()
        .into_iter()
        .chain(["cc", "gcc", "clang"].map(String::from));
    candidates.into_iter().find(|c| {
        std::process::Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    kernel_struct! {
        #[derive(Debug, PartialEq)]
        struct Sample {
            a: i32,
            /// A documented field.
            b: f32,
            c: [u32; 3],
            d: [f32; 2],
        }
    }

    #[test]
    fn a_float_table_reads_back_the_same_floats() {
        let values: Vec<f32> = (0..=255u32).map(|c| c as f32 / 255.0).collect();
        let text = c_float_table("T", &values);
        assert!(text.starts_with("__device__ const float T[256] = {0.0f, "));
        let inner = &text[text.find('{').unwrap() + 1..text.rfind('}').unwrap()];
        let back: Vec<f32> = inner
            .split(", ")
            .map(|v| v.trim_end_matches('f').parse().unwrap())
            .collect();
        assert_eq!(back, values);
    }

    #[test]
    fn the_macro_declares_both_sides() {
        assert_eq!(
            Sample::c_declaration(),
            "typedef struct Sample {\n    int a;\n    float b;\n    unsigned int c[3];\n    \
             float d[2];\n} Sample;\n"
        );
        let offsets: Vec<(&str, usize, usize)> = Sample::fields()
            .iter()
            .map(|f| (f.name, f.offset, f.size))
            .collect();
        assert_eq!(
            offsets,
            [("a", 0, 4), ("b", 4, 4), ("c", 8, 12), ("d", 20, 8)]
        );
        let s = Sample {
            a: 1,
            b: 2.0,
            c: [3, 4, 5],
            d: [6.0, 7.0],
        };
        assert_eq!(&bytemuck::bytes_of(&s)[..4], &1i32.to_ne_bytes());
        assert_eq!(
            bytemuck::pod_read_unaligned::<Sample>(bytemuck::bytes_of(&s)),
            s
        );
    }

    #[test]
    fn float_defines_read_back_exactly() {
        for v in [0.005f32, 0.1, 1.0 / 3.0, 8.0, 1e-10, 123456.79] {
            let d = Define::float("X", v);
            let text = d.c_value();
            let back: f32 = text.trim_end_matches('f').parse().unwrap();
            assert_eq!(back.to_bits(), v.to_bits(), "{text}");
        }
        assert_eq!(Define::int("N", 8u32).c_text(), "#define N 8\n");
    }

    #[test]
    fn the_c_compiler_check_catches_a_wrong_offset() {
        let header = c_header("test", &[Define::int("N", 3)], &[Sample::c_declaration()]);
        let good = StructLayout::of::<Sample>();
        match c_compiler_check(&header, std::slice::from_ref(&good), &[Define::int("N", 3)]) {
            Ok(CCheck::NoCompiler) => {
                println!("skipped: no C compiler found ($CC, cc, gcc or clang)");
                return;
            }
            Ok(CCheck::Agreed { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        // The same header against a Rust side with `d` moved by 4 bytes, and another constant.
        let mut bad = good;
        bad.fields[3].offset += 4;
        let e = c_compiler_check(&header, &[bad], &[Define::int("N", 4)]).unwrap_err();
        assert!(e.contains("offsetof Sample.d 24"), "{e}");
        assert!(e.contains("define N 4"), "{e}");
    }
}
