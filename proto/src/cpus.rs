//! CPU lists such as `0-1,3`: the format of `taskset -c`, cpuset files, the `iothread_cpus`
//! field of the gRPC API and the frontend's `--iothread-cpus`.

/// Parses a CPU list into CPU numbers, sorted and without duplicates. Every CPU must be below
/// `CPU_SETSIZE`, so the result always fits a `cpu_set_t`.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let limit = libc::CPU_SETSIZE as usize;
    let mut cpus = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("{part:?} is not a CPU number or a range like 0-3"))
        };
        let (first, last) = (parse(first)?, parse(last)?);
        if first > last {
            return Err(format!("range {part:?} is backwards"));
        }
        if last >= limit {
            return Err(format!("CPU {last} is beyond {}", limit.saturating_sub(1)));
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_ranges_and_errors() {
        assert_eq!(parse_cpu_list("0"), Ok(vec![0]));
        assert_eq!(parse_cpu_list("0-2,5,1"), Ok(vec![0, 1, 2, 5]));
        assert_eq!(parse_cpu_list("3, 1-2 ,1"), Ok(vec![1, 2, 3]));
        for bad in ["", "a", "1-", "-1", "2-1", "1,,2", "0-100000"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?}");
        }
    }
}
