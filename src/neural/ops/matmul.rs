//! MatMul (numpy semantics: 1-D operands promoted, batch axes broadcast) and Gemm.
//!
//! Plain kernel: [`matmul_2d`] (row-major, threaded over output rows).

use super::elementwise::{broadcast_shape, broadcast_zip};
use super::{Node, par_chunks_mut, strides};
use crate::neural::NeuralError;
use crate::neural::tensor::{Tensor, Value};

/// One output row: `out[j] = Σ_k a_row[k] · b[k, j]` (b is `[k, n]` row-major), as axpys over
/// the rows of b so the inner loop is contiguous.
fn row_times(out: &mut [f32], a_row: &[f32], b: &[f32], n: usize) {
    out.fill(0.0);
    for (kk, &av) in a_row.iter().enumerate() {
        for (o, &bv) in out.iter_mut().zip(&b[kk * n..][..n]) {
            *o += av * bv;
        }
    }
}

/// `[m, k] × [k, n]` → `[m, n]`, row-major.
pub fn matmul_2d(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, NeuralError> {
    if a.len() != m * k || b.len() != k * n {
        return Err(NeuralError::Graph(format!(
            "matmul: buffers {} / {} for [{m}, {k}] × [{k}, {n}]",
            a.len(),
            b.len()
        )));
    }
    let mut out = vec![0.0; m * n];
    par_chunks_mut(&mut out, n, n * k, |i, row| {
        row_times(row, &a[i * k..][..k], b, n)
    });
    Ok(out)
}

pub(crate) fn run_matmul(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (a, b) = (ctx.float(0)?, ctx.float(1)?);
    if a.rank() == 0 || b.rank() == 0 {
        return Err(ctx.graph_err("MatMul of a scalar"));
    }
    // Promote 1-D operands to matrices, remembering to drop the added axis.
    let a_shape = if a.rank() == 1 {
        vec![1, a.shape[0]]
    } else {
        a.shape.clone()
    };
    let b_shape = if b.rank() == 1 {
        vec![b.shape[0], 1]
    } else {
        b.shape.clone()
    };
    let (m, k) = (a_shape[a_shape.len() - 2], a_shape[a_shape.len() - 1]);
    let (k2, n) = (b_shape[b_shape.len() - 2], b_shape[b_shape.len() - 1]);
    if k != k2 {
        return Err(ctx.graph_err(format!(
            "shapes {:?} and {:?} do not multiply",
            a.shape, b.shape
        )));
    }
    let a_batch = &a_shape[..a_shape.len() - 2];
    let b_batch = &b_shape[..b_shape.len() - 2];
    let batch = broadcast_shape(a_batch, b_batch).ok_or_else(|| {
        ctx.graph_err(format!(
            "batch axes of {:?} and {:?} do not broadcast",
            a.shape, b.shape
        ))
    })?;
    // Offsets of every output batch in a and b.
    let nb: usize = batch.iter().product();
    let offsets = |own: &[usize], mat: usize| -> Vec<usize> {
        let pad = batch.len() - own.len();
        let own_strides = strides(own);
        (0..nb)
            .map(|bi| {
                let (mut rem, mut off) = (bi, 0);
                for ax in (0..batch.len()).rev() {
                    let c = rem % batch[ax];
                    rem /= batch[ax];
                    if ax >= pad && own[ax - pad] != 1 {
                        off += c * own_strides[ax - pad];
                    }
                }
                off * mat
            })
            .collect()
    };
    let (a_off, b_off) = (offsets(a_batch, m * k), offsets(b_batch, k * n));
    let mut out = vec![0.0; nb * m * n];
    par_chunks_mut(&mut out, n, n * k, |r, row| {
        let (bi, i) = (r / m.max(1), r % m.max(1));
        row_times(
            row,
            &a.data[a_off[bi] + i * k..][..k],
            &b.data[b_off[bi]..][..k * n],
            n,
        );
    });
    let mut shape = batch;
    if a.rank() > 1 {
        shape.push(m);
    }
    if b.rank() > 1 {
        shape.push(n);
    }
    Ok(vec![Value::Float(Tensor::new(shape, out))])
}

fn transpose_2d(t: &Tensor<f32>) -> Tensor<f32> {
    let (r, c) = (t.shape[0], t.shape[1]);
    let mut data = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            data[j * r + i] = t.data[i * c + j];
        }
    }
    Tensor::new(vec![c, r], data)
}

/// Gemm: `alpha · A' · B' + beta · C`, A' and B' optionally transposed, C broadcast to
/// `[m, n]`.
pub(crate) fn run_gemm(ctx: &Node) -> Result<Vec<Value>, NeuralError> {
    let (a, b) = (ctx.float(0)?, ctx.float(1)?);
    if a.rank() != 2 || b.rank() != 2 {
        return Err(ctx.graph_err(format!(
            "A {:?} and B {:?} must be matrices",
            a.shape, b.shape
        )));
    }
    let alpha = ctx.attr_float("alpha", 1.0)?;
    let beta = ctx.attr_float("beta", 1.0)?;
    let a = if ctx.attr_int("transA", 0)? != 0 {
        transpose_2d(a)
    } else {
        a.clone()
    };
    let b = if ctx.attr_int("transB", 0)? != 0 {
        transpose_2d(b)
    } else {
        b.clone()
    };
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    if b.shape[0] != k {
        return Err(ctx.graph_err(format!(
            "A' {:?} and B' {:?} do not multiply",
            a.shape, b.shape
        )));
    }
    let mut y = Tensor::new(vec![m, n], matmul_2d(&a.data, &b.data, m, k, n)?);
    if alpha != 1.0 {
        y.data.iter_mut().for_each(|v| *v *= alpha);
    }
    if let Some(c) = ctx.opt_float(2)? {
        let sum = broadcast_zip(&y, c, |v, cv| v + beta * cv)
            .filter(|s| s.shape == y.shape)
            .ok_or_else(|| {
                ctx.graph_err(format!("C {:?} does not broadcast to [{m}, {n}]", c.shape))
            })?;
        y = sum;
    }
    Ok(vec![Value::Float(y)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_2d_small_known_product() {
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
        let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0]; // [3, 2]
        assert_eq!(
            matmul_2d(&a, &b, 2, 3, 2).unwrap(),
            vec![58.0, 64.0, 139.0, 154.0]
        );
        assert!(matmul_2d(&a, &b, 3, 3, 2).is_err());
    }
}
