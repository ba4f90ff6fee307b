//! Line charts in PNG and SVG (the `plotters` crate), drawn with the font in assets/ so that
//! no system font is needed.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use ringattn::{Error, Result};

/// DejaVu Sans, subset to Latin-1 and a few symbols (assets/LICENSE-DejaVu.txt).
static FONT: &[u8] = include_bytes!("../../../assets/DejaVuSans-subset.ttf");

/// Chart size in pixels.
const SIZE: (u32, u32) = (960, 600);

/// Distinguishable line colours (Okabe–Ito, then greys).
const COLORS: [RGBColor; 9] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
    RGBColor(120, 120, 120),
];

/// Registers the carried font as plotters' `sans-serif`, once.
fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument("plot: the font in assets/ could not be loaded".into()))
    }
}

/// A compact tick label: powers of two from 16384 as `16k`, `1M` (token counts); other
/// values with three significant digits.
pub fn tick(v: f64) -> String {
    if v >= 16384.0 && v.fract() == 0.0 && (v as u64).is_power_of_two() {
        let k = (v as u64).trailing_zeros();
        return if k >= 20 { format!("{}M", 1u64 << (k - 20)) } else { format!("{}k", 1u64 << (k - 10)) };
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.0e}")
    } else {
        let digits = (2 - a.log10().floor() as i32).max(0) as usize;
        let s = format!("{v:.digits$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
}

/// The chart's content.
struct Spec<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: Vec<(&'a str, Vec<(f64, f64)>)>,
}

/// The range of `values` for an axis, padded; log axes keep positive values only.
fn axis_range(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() || !hi.is_finite() {
        return (1.0, 10.0);
    }
    if log {
        let (lo, hi) = if lo == hi { (lo / 2.0, hi * 2.0) } else { (lo, hi) };
        (lo / 1.15, hi * 1.15)
    } else {
        let pad = if lo == hi { lo.abs().max(1.0) * 0.1 } else { (hi - lo) * 0.05 };
        (lo - pad, hi + pad)
    }
}

/// The scale of an axis asked to be logarithmic: linear when its range spans less than 8×
/// (a log axis would have too few ticks), base 2 up to 2¹² (a tick per doubling), else
/// base 10.
fn log_base(lo: f64, hi: f64) -> Option<f64> {
    match hi / lo {
        r if r < 8.0 => None,
        r if r <= 4096.0 => Some(2.0),
        _ => Some(10.0),
    }
}

fn draw<DB: DrawingBackend, X, Y>(
    root: &DrawingArea<DB, Shift>,
    spec: &Spec,
    x: X,
    y: Y,
) -> std::result::Result<(), String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(root)
        .caption(spec.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(spec.x_label)
        .y_desc(spec.y_label)
        .x_label_formatter(&|v: &f64| tick(*v))
        .y_label_formatter(&|v: &f64| tick(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, pts)) in spec.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| e.to_string())?;
    }
    if !spec.series.is_empty() {
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

fn render<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    spec: &Spec,
    log_x: bool,
    log_y: bool,
) -> std::result::Result<(), String> {
    let (x0, x1) = axis_range(spec.series.iter().flat_map(|s| s.1.iter().map(|p| p.0)), log_x);
    let (y0, y1) = axis_range(spec.series.iter().flat_map(|s| s.1.iter().map(|p| p.1)), log_y);
    let bx = if log_x { log_base(x0, x1) } else { None };
    let by = if log_y { log_base(y0, y1) } else { None };
    // A log axis turned linear keeps the log axis' padding, which is fine.
    match (bx, by) {
        (None, None) => draw(root, spec, x0..x1, y0..y1),
        (Some(bx), None) => draw(root, spec, (x0..x1).log_scale().base(bx), y0..y1),
        (None, Some(by)) => draw(root, spec, x0..x1, (y0..y1).log_scale().base(by)),
        (Some(bx), Some(by)) => draw(root, spec, (x0..x1).log_scale().base(bx), (y0..y1).log_scale().base(by)),
    }
}

/// Draws a line chart of `series` (name, points) and writes it as `{stem}.png` and
/// `{stem}.svg`, each atomically (a temporary file in the same directory, then a rename).
/// Points that are not finite, or not positive on a log axis, are left out; series left
/// empty are skipped. Returns the two paths.
///
/// # Errors
/// [`Error::Io`] when a file cannot be written or the chart cannot be drawn,
/// [`Error::InvalidArgument`] when the font cannot be loaded.
pub fn line_chart(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
) -> Result<Vec<PathBuf>> {
    register_font()?;
    let keep = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite() && (!log_x || x > 0.0) && (!log_y || y > 0.0);
    let series = series
        .iter()
        .map(|(n, pts)| (n.as_str(), pts.iter().copied().filter(keep).collect::<Vec<_>>()))
        .filter(|s| !s.1.is_empty())
        .collect();
    let spec = Spec { title, x_label, y_label, series };
    let with_ext = |ext: &str| {
        let mut name = stem.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(format!(".{ext}"));
        stem.with_file_name(name)
    };
    let (png, svg) = (with_ext("png"), with_ext("svg"));
    let fail = |path: &Path, e: String| Error::Io { path: path.to_path_buf(), source: std::io::Error::other(e) };

    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        render(&root, &spec, log_x, log_y).map_err(|e| fail(&svg, e))?;
    }
    ringattn::io::write_atomic(&svg, text.as_bytes())?;

    // The PNG encoder picks the format from the extension: the temporary name keeps `.png`.
    let tmp = png.with_file_name(format!(
        ".{}.tmp-{}.png",
        stem.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        std::process::id()
    ));
    let drawn = {
        let root = BitMapBackend::new(&tmp, SIZE).into_drawing_area();
        render(&root, &spec, log_x, log_y)
    };
    let result = drawn
        .map_err(|e| fail(&png, e))
        .and_then(|()| std::fs::rename(&tmp, &png).map_err(|source| Error::Io { path: png.clone(), source }));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    Ok(vec![png, svg])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks() {
        assert_eq!(tick(32768.0), "32k");
        assert_eq!(tick(4194304.0), "4M");
        assert_eq!(tick(8.0), "8");
        assert_eq!(tick(12.345), "12.3");
        assert_eq!(tick(0.5), "0.5");
        assert_eq!(tick(1500.0), "1500");
        assert_eq!(tick(1024.0), "1024");
        assert_eq!(tick(2e6), "2e6");
    }
}
