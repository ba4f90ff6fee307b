//! [`Checkpoint`]: gradient checkpointing for candle, which has no API for it — a block's
//! forward runs without keeping its activations, and is recomputed inside the backward.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, Shape, Tensor, Var};

/// A block `f` of the model, `y = f(x)`, over parameters the closure holds.
type Block = dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// Gradient checkpointing (activation recomputation) for candle: [`Checkpoint::apply`] runs a
/// block `y = f(x)` — a transformer layer, its ringattn attention included — keeping only
/// `x` and `y`; candle's backward recomputes `f` from `x` and backpropagates through the
/// recomputation. The gradients of the block's parameters are gathered here and added to
/// the step's gradients by [`Checkpoint::merge_into`] (a candle operation can only return
/// gradients for its inputs).
///
/// With ringattn's attention inside `f`, the recomputation calls it again, collectively:
/// every rank's backward visits the blocks in the same order, so the ranks recompute and
/// backpropagate together (the group's plans are reused; nothing is re-planned).
///
/// Memory: a block's activations (the attention's saved o, LSE and inputs, its projections
/// and MLP intermediates) live only during its own recomputation, not from the forward to
/// the backward; the cost is one more forward per block.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use ringattn::candle::Checkpoint;
/// let w = Var::from_tensor(&Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?)?;
/// let x = Var::from_tensor(&Tensor::new(&[[1f32, 1.]], &Device::Cpu)?)?;
/// let ck = Checkpoint::new();
/// let wc = w.clone();
/// let y = ck.apply(x.as_tensor(), &[w.clone()], move |x| x.matmul(wc.as_tensor())?.tanh())?;
/// let mut grads = y.sum_all()?.backward()?;
/// ck.merge_into(&mut grads)?;
/// assert!(grads.get(w.as_tensor()).is_some() && grads.get(x.as_tensor()).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct Checkpoint {
    /// The parameters' gradients gathered by the recomputations, in order.
    grads: Arc<Mutex<Vec<(Var, Tensor)>>>,
}

/// The operation that stands for a checkpointed block in candle's graph: its forward returns
/// the block's output computed outside the graph; its backward recomputes the block.
struct Recompute {
    block: Arc<Block>,
    params: Vec<Var>,
    grads: Arc<Mutex<Vec<(Var, Tensor)>>>,
}

impl CustomOp2 for Recompute {
    fn name(&self) -> &'static str {
        "ringattn-checkpoint"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        y: &CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((y.try_clone(l)?, l.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        y: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((y.try_clone(l)?, l.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The block again, from a fresh leaf of x's values, then its backward with the
        // output's gradient: d/dθ Σ (f(x) ∘ g) = the block's vector-Jacobian product.
        let leaf = Var::from_tensor(&x.detach().copy()?)?;
        let y = (self.block)(leaf.as_tensor())?;
        let inner = (y * grad_res.detach())?.sum_all()?.backward()?;
        // Detached: candle's gradients can still record the operations that made them, and so
        // keep the recomputed block's whole graph (its activations) alive after the backward.
        let mut gathered = self.grads.lock().unwrap_or_else(|e| e.into_inner());
        for p in &self.params {
            if let Some(g) = inner.get(p.as_tensor()) {
                gathered.push((p.clone(), g.detach()));
            }
        }
        Ok((inner.get(leaf.as_tensor()).map(Tensor::detach), None))
    }
}

impl Checkpoint {
    /// An empty checkpoint store (one per step, or reused: [`Checkpoint::merge_into`]
    /// empties it).
    pub fn new() -> Self {
        Self::default()
    }

    /// `y = f(x)` in candle's graph without `f`'s activations: `f` runs now on `x`'s values
    /// (outside the graph) and again in the backward. `params` are the variables `f` uses
    /// whose gradients the step needs; they are gathered for [`Checkpoint::merge_into`].
    /// `f` must be deterministic (it runs twice; ringattn's attention is).
    ///
    /// # Errors
    /// `f`'s errors; candle errors.
    pub fn apply<F>(&self, x: &Tensor, params: &[Var], f: F) -> candle_core::Result<Tensor>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        // The forward outside the graph: nothing of it is kept but its output.
        let y = f(&x.detach())?.detach().contiguous()?.copy()?;
        // An input that tracks no gradient (data) would leave the operation out of the graph,
        // and the parameters without gradients: a variable of its values stands in for it.
        let x = if x.track_op() { x.clone() } else { Var::from_tensor(&x.detach().copy()?)?.into_inner() };
        let op = Recompute { block: Arc::new(f), params: params.to_vec(), grads: self.grads.clone() };
        x.apply_op2_arc(&y, Arc::new(Box::new(op)))
    }

    /// Adds the gathered parameter gradients into `grads` (the step's backward result) and
    /// empties the store.
    ///
    /// # Errors
    /// candle errors (a gradient of another shape or device than its parameter's).
    pub fn merge_into(&self, grads: &mut GradStore) -> candle_core::Result<()> {
        let gathered = std::mem::take(&mut *self.grads.lock().unwrap_or_else(|e| e.into_inner()));
        for (p, g) in gathered {
            let sum = match grads.get(p.as_tensor()) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            grads.insert(p.as_tensor(), sum);
        }
        Ok(())
    }
}
