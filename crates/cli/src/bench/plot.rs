//! The `--plot` picture: bandwidth against block size, one line per copy path and the
//! same-run `peer_copy` baseline as a dashed line, drawn by plotters into SVG text. Block
//! sizes go on a base-2 log scale.

use super::report::{Report, Row};
use super::workload::{size, SWEEP_BYTES, SWEEP_MOST_BLOCKS};
use plotters::prelude::*;
use std::f64::consts::SQRT_2;

/// Size of the picture in pixels.
const SIZE: (u32, u32) = (860, 460);
/// Colours of the copy paths' lines, in the order the paths first appear.
const COLOURS: [RGBColor; 4] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
];
/// Colour of the baseline.
const BASELINE: RGBColor = RGBColor(0x55, 0x55, 0x55);

/// Drawing the plot failed.
#[derive(Debug, thiserror::Error)]
#[error(
    "could not draw the --plot SVG: {0}; the table above and any --json file are complete, \
     so rerun with --plot only to retry the picture"
)]
pub(crate) struct PlotError(String);

/// The SVG text of `report`'s sweep: GB/s against block size (log scale) per copy path.
pub(crate) fn svg(report: &Report) -> Result<String, PlotError> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, SIZE).into_drawing_area();
        draw(&root, report).map_err(|error| PlotError(error.to_string()))?;
        root.present()
            .map_err(|error| PlotError(error.to_string()))?;
    }
    Ok(text)
}

/// How many powers of two `sizes` round up to: one axis label each, so sizes that differ by a
/// few bytes (4 KiB and 4097 B) share a label.
fn powers_of_two(sizes: &[u64]) -> usize {
    let mut powers: Vec<u64> = sizes.iter().map(|size| size.next_power_of_two()).collect();
    powers.dedup();
    powers.len()
}

/// What drawing on the SVG backend may fail with.
type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// Draws the axes, one line per path, the baseline and the legend on `root`.
fn draw(root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, report: &Report) -> DrawResult {
    root.fill(&WHITE)?;
    let points: Vec<&Row> = report
        .sweep
        .iter()
        .filter(|row| row.gbps.is_some())
        .collect();
    let mut sizes: Vec<u64> = points.iter().map(|row| row.block_bytes.max(1)).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // Half a power of two of room on either side, so the end points sit inside the axes.
    let (low, high) = match (sizes.first(), sizes.last()) {
        (Some(&low), Some(&high)) => (low as f64 / SQRT_2, high as f64 * SQRT_2),
        _ => (4096.0 / SQRT_2, f64::from(1u32 << 30) * SQRT_2),
    };
    let top = points
        .iter()
        .filter_map(|row| row.gbps)
        .fold(report.peer_copy_gbps.unwrap_or(0.0), f64::max)
        * 1.1;
    let top = if top > 0.0 { top } else { 1.0 };
    let x = (low..high).log_scale().base(2.0);
    let mut chart = ChartBuilder::on(root)
        .caption(
            format!(
                "ferry bench: GPU{} -> GPU{}, scattered blocks, up to {} or {} blocks a point",
                report.prefill_gpu,
                report.decode_gpu,
                size(SWEEP_BYTES),
                SWEEP_MOST_BLOCKS
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(x, 0.0..top)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .x_desc("block size")
        .y_desc("GB/s")
        .x_labels(powers_of_two(&sizes).max(2))
        .x_label_formatter(&|bytes| size(bytes.round() as u64))
        .y_label_formatter(&|gbps| format!("{gbps:.0}"))
        .disable_x_mesh()
        .light_line_style(WHITE)
        .draw()?;
    let mut paths: Vec<&str> = Vec::new();
    for row in &points {
        if !paths.contains(&row.path.as_str()) {
            paths.push(&row.path);
        }
    }
    for (path, colour) in paths.iter().zip(COLOURS.iter().cycle()) {
        let line: Vec<(f64, f64)> = points
            .iter()
            .filter(|row| row.path == *path)
            .filter_map(|row| Some((row.block_bytes.max(1) as f64, row.gbps?)))
            .collect();
        let style = colour.stroke_width(2);
        chart
            .draw_series(LineSeries::new(line, style).point_size(3))?
            .label(*path)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
    }
    if let Some(gbps) = report.peer_copy_gbps {
        chart
            .draw_series(DashedLineSeries::new(
                [(low, gbps), (high, gbps)],
                6,
                4,
                BASELINE.stroke_width(1),
            ))?
            .label(format!("peer_copy {gbps:.0} GB/s"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], BASELINE.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
}

#[cfg(test)]
mod tests {
    use super::svg;
    use crate::bench::report::tests::report;

    /// Whether `svg` has a text element reading exactly `text`.
    fn has_text(svg: &str, text: &str) -> bool {
        svg.contains(&format!(">\n{text}\n</text>"))
    }

    #[test]
    fn the_plot_names_every_path_the_baseline_the_axes_and_the_sizes() {
        let svg = svg(&report()).expect("the plot draws");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
        for text in [
            "kernel",
            "copy-engine",
            "peer_copy 400 GB/s",
            "block size",
            "GB/s",
            "4K",
            "1M",
            "0",
            "400",
            "ferry bench: GPU0 -&gt; GPU1, scattered blocks, up to 256M or 65536 blocks a point",
        ] {
            assert!(has_text(&svg, text), "no text {text:?} in {svg}");
        }
        // Two measured points on each of the two paths' lines.
        assert_eq!(svg.matches("<circle").count(), 4, "{svg}");
        assert!(svg.contains("#1F77B4") && svg.contains("#D62728"), "{svg}");
        // The baseline is a run of dashes across the plot.
        assert!(svg.matches("#555555").count() > 10, "{svg}");
    }

    #[test]
    fn a_report_without_a_sweep_still_draws_its_axes_and_baseline() {
        let mut report = report();
        report.sweep.clear();
        let svg = svg(&report).expect("the plot draws");
        assert!(has_text(&svg, "peer_copy 400 GB/s"), "{svg}");
        assert!(has_text(&svg, "block size"), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 0, "{svg}");
    }
}
