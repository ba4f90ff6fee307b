//! Every bad input gets its typed error naming the offending value, never a panic.

use ringattn::{cpu, io, reference, AttentionParams, DType, Documents, Error, Mask, Positions, Tensor};

fn t(shape: &[usize], dt: DType) -> Tensor {
    Tensor::zeros(shape.to_vec(), dt)
}

fn fwd(q: &Tensor, k: &Tensor, v: &Tensor) -> Error {
    cpu::forward(q, k, v, &AttentionParams::default()).unwrap_err()
}

#[test]
fn rank_mismatch_names_the_tensor_and_shape() {
    let e = fwd(&t(&[1, 4, 2], DType::F32), &t(&[1, 4, 2, 8], DType::F32), &t(&[1, 4, 2, 8], DType::F32));
    assert!(matches!(e, Error::Rank { name: "q", .. }), "{e}");
    assert!(e.to_string().contains("[1, 4, 2]"));
}

#[test]
fn shape_mismatches() {
    let f = DType::F32;
    let e = fwd(&t(&[1, 4, 2, 8], f), &t(&[1, 4, 2, 8], f), &t(&[1, 5, 2, 8], f));
    assert!(matches!(e, Error::ShapeMismatch(_)) && e.to_string().contains("[1, 5, 2, 8]"), "{e}");
    let e = fwd(&t(&[2, 4, 2, 8], f), &t(&[1, 4, 2, 8], f), &t(&[1, 4, 2, 8], f));
    assert!(e.to_string().contains("batch 2"), "{e}");
    let e = fwd(&t(&[1, 4, 2, 16], f), &t(&[1, 4, 2, 8], f), &t(&[1, 4, 2, 8], f));
    assert!(e.to_string().contains("head dim 16"), "{e}");
}

#[test]
fn head_ratio_and_zero_heads() {
    let f = DType::F32;
    let e = fwd(&t(&[1, 4, 3, 8], f), &t(&[1, 4, 2, 8], f), &t(&[1, 4, 2, 8], f));
    assert!(matches!(e, Error::HeadRatio { h_q: 3, h_kv: 2 }), "{e}");
    let e = fwd(&t(&[1, 4, 2, 8], f), &t(&[1, 4, 0, 8], f), &t(&[1, 4, 0, 8], f));
    assert!(matches!(e, Error::ZeroHeads { name: "h_kv" }), "{e}");
}

#[test]
fn head_dim_zero_or_too_large() {
    let f = DType::F32;
    let e = fwd(&t(&[1, 4, 1, 0], f), &t(&[1, 4, 1, 0], f), &t(&[1, 4, 1, 0], f));
    assert!(matches!(e, Error::HeadDim { d: 0, .. }), "{e}");
    let e = fwd(&t(&[1, 1, 1, 513], f), &t(&[1, 1, 1, 513], f), &t(&[1, 1, 1, 513], f));
    assert!(matches!(e, Error::HeadDim { name: "d_qk", d: 513, max: 512 }), "{e}");
    let e = fwd(&t(&[1, 1, 1, 8], f), &t(&[1, 1, 1, 8], f), &t(&[1, 1, 1, 513], f));
    assert!(matches!(e, Error::HeadDim { name: "d_v", d: 513, max: 512 }), "{e}");
}

#[test]
fn dtype_mismatch_names_the_tensor() {
    let e = fwd(&t(&[1, 4, 1, 8], DType::F32), &t(&[1, 4, 1, 8], DType::BF16), &t(&[1, 4, 1, 8], DType::F32));
    assert!(matches!(&e, Error::DtypeMismatch { name, .. } if name == "k"), "{e}");
    let q = t(&[1, 4, 1, 8], DType::F32);
    let f = cpu::forward(&q, &q, &q, &AttentionParams::default()).unwrap();
    let e = cpu::backward(&q, &q, &q, &f.o, &f.lse, &t(&[1, 4, 1, 8], DType::F16), &AttentionParams::default())
        .unwrap_err();
    assert!(matches!(&e, Error::DtypeMismatch { name, .. } if name == "do"), "{e}");
    let e = cpu::backward(&q, &q, &q, &f.o, &f.lse.to_dtype(DType::BF16), &q, &AttentionParams::default()).unwrap_err();
    assert!(matches!(&e, Error::DtypeMismatch { name, .. } if name == "lse"), "{e}");
}

#[test]
fn bad_windows_scales_softcaps_documents_positions() {
    assert!(matches!(Mask::from_signed_window(-2, 0), Err(Error::Window(_))));
    assert!(Mask::from_signed_window(-1, -1).is_ok());
    let q = t(&[1, 4, 1, 8], DType::F32);
    let e = cpu::forward(&q, &q, &q, &AttentionParams { scale: Some(f32::NAN), ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Scale(_)), "{e}");
    for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = cpu::forward(&q, &q, &q, &AttentionParams { softcap: Some(cap), ..Default::default() }).unwrap_err();
        assert!(
            matches!(e, Error::ScoreOption { option: "softcap", value, .. } if value.to_bits() == cap.to_bits()),
            "{cap}: {e}"
        );
        let e = ringattn::reference::forward(&q, &q, &q, &AttentionParams { softcap: Some(cap), ..Default::default() });
        assert!(matches!(e, Err(Error::ScoreOption { .. })), "the oracle with softcap {cap}");
    }
    let docs = Documents::new(vec![2, 3]).unwrap();
    let e = cpu::forward(&q, &q, &q, &AttentionParams { documents: Some(docs), ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Documents(_)) && e.to_string().contains("sum to 5"), "{e}");
    assert!(matches!(Documents::new(vec![]), Err(Error::Documents(_))));
    let e = cpu::forward_at(
        &q,
        &q,
        &q,
        &Positions::contiguous(0, 3),
        &Positions::contiguous(0, 4),
        &AttentionParams::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Positions(_)) && e.to_string().contains("3 query positions"), "{e}");
    assert!(matches!(Positions::strided(0, 0, 4), Err(Error::Positions(_))));
    assert!(matches!(Positions::strided(i64::MAX - 1, 5, 4), Err(Error::Positions(_))));
}

#[test]
fn tensor_data_length_and_dtype_names() {
    assert!(matches!(Tensor::from_f32(vec![2, 3], vec![0.0; 5]), Err(Error::DataLength { len: 5, expected: 6, .. })));
    assert!(matches!("f64".parse::<DType>(), Err(Error::UnsupportedDtype(_))));
}

#[test]
fn reference_rejects_rows_out_of_range() {
    let q = t(&[1, 4, 1, 8], DType::F32);
    let e = reference::rows(&q, &q, &q, None, &AttentionParams::default(), &[4], None).unwrap_err();
    assert!(e.to_string().contains("row 4"), "{e}");
}

#[test]
fn files_missing_malformed_or_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.safetensors");
    assert!(matches!(io::read_inputs(&missing), Err(Error::Io { .. })));
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    assert!(matches!(io::read_inputs(&junk), Err(Error::Format { .. })));
    let partial = dir.path().join("partial.safetensors");
    let q = t(&[1, 4, 1, 8], DType::F32);
    io::write_tensors(&partial, &[("q", &q), ("k", &q)]).unwrap();
    let e = io::read_inputs(&partial).unwrap_err();
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "v"), "{e}");
    let mixed = dir.path().join("mixed.safetensors");
    io::write_tensors(&mixed, &[("q", &q), ("k", &q), ("v", &q.to_dtype(DType::F16))]).unwrap();
    assert!(matches!(io::read_inputs(&mixed), Err(Error::DtypeMismatch { .. })));
    let unwritable = dir.path().join("no-such-dir").join("out.safetensors");
    assert!(matches!(io::write_tensors(&unwritable, &[("q", &q)]), Err(Error::Io { .. })));
}

#[test]
fn partial_reads_check_the_file_and_the_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let x = ringattn::random::randn(vec![2, 9, 3, 4], 7, DType::BF16);
    io::write_tensors(&path, &[("q", &x), ("k", &x), ("v", &x)]).unwrap();
    let f = io::TensorFile::open(&path).unwrap();
    // Rows read piecewise equal the same rows sharded from the whole tensor.
    let pos = Positions::from_segments(vec![
        ringattn::Segment { start: 7, stride: 1, len: 2 },
        ringattn::Segment { start: 0, stride: 3, len: 3 },
    ])
    .unwrap();
    assert_eq!(f.read_rows("q", &pos).unwrap(), ringattn::Layout::shard_rows(&x, &pos).unwrap());
    assert!(f.read_input_rows(&pos).unwrap().d_o.is_none());
    let e = f.read_rows("q", &Positions::contiguous(5, 5)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch(_)) && e.to_string().contains("9 rows"), "{e}");
    assert!(matches!(f.read_rows("do", &pos).unwrap_err(), Error::MissingTensor { .. }));
    // A truncated file is refused when opened, naming the file.
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let e = io::TensorFile::open(&cut).unwrap_err();
    assert!(matches!(e, Error::Format { .. }) && e.to_string().contains("cut.safetensors"), "{e}");
    std::fs::write(&cut, &bytes[..4]).unwrap();
    assert!(matches!(io::TensorFile::open(&cut).unwrap_err(), Error::Format { .. }));
}
