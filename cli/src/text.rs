//! Plain-text building blocks of blkplanectl's output: sizes read and written with binary
//! suffixes, and tables aligned by column.

/// Parses a size: bytes, or a number with a binary unit `K`, `M`, `G`, `T`, `P` (optionally
/// followed by `iB` or `B`; all units are powers of 1024). `1G`, `1GiB`, `512M`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits == 0 {
        return Err(format!("{s:?} is not a size like 4096, 512M or 2GiB"));
    }
    let n: u64 = t[..digits]
        .parse()
        .map_err(|_| format!("{s:?} is too large"))?;
    let unit = t[digits..].trim();
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        "P" | "PB" | "PIB" => 50,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use K, M, G, T or P)"
            ))
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A byte count for people: `1.0 GiB`, `512 B`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Renders rows under headers with aligned columns (the last column is not padded).
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<&str> = cells.collect();
        let n = cells.len();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == n {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size(" 1 G "), Ok(1 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        for bad in [
            "",
            "G",
            "-1",
            "1.5G",
            "1X",
            "99999999999999999999",
            "20000000P",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1 << 30), "1.0 GiB");
        assert_eq!(format_bytes(3 << 19), "1.5 MiB");
    }
}
