//! Importer for the DAPPLE artifact's text profiles (PipeDream's graph.txt).
//!
//! A graph.txt file lists one node per line,
//! `nodeN -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>, activation_size=<bytes>, parameter_size=<bytes>`,
//! then one edge per line, indented, `nodeA -- nodeB` (A feeds B). The
//! planner wants a chain, so the nodes are put in topological order and the
//! graph edges are kept in `Layer::inputs`.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use regex::Regex;

use crate::error::{Error, Result};
use crate::model::profile::{Layer, Measurement, Profile, BLOCK_KIND};

#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Model name for the profile, e.g. "GNMT-16".
    pub model: String,
    /// Batch size the file was measured at (the `pbs-N` in the file name).
    pub batch_size: u32,
    /// Multiplier for `parameter_size`: 1.0 normally; 1.048576 for the
    /// hand-written VGG-19 file, whose sizes are bytes / 1.048576.
    pub param_bytes_scale: f64,
    /// Regex; layers whose name matches get `kind = Some("block")`.
    pub block_pattern: Option<String>,
    pub source: Option<String>,
    pub device: Option<String>,
    pub optimizer: String,
}

const SEPARATOR: &str = " -- ";
const METRIC_KEYS: [&str; 4] = [
    "forward_compute_time",
    "backward_compute_time",
    "activation_size",
    "parameter_size",
];

/// A node as written in the file; its index in `Graph::nodes` is its file position.
struct Node {
    id: String,
    name: String,
    line: usize,
    fwd_ms: f64,
    bwd_ms: f64,
    activation_bytes: f64,
    parameter_bytes: f64,
}

struct Graph {
    nodes: Vec<Node>,
    /// predecessors[i]: file positions of the nodes feeding node i.
    predecessors: Vec<BTreeSet<usize>>,
}

/// Parse a graph.txt text into a profile measured at `opts.batch_size`.
/// Errors name the line; the caller attaches the file name.
pub fn import_graph_txt(text: &str, opts: &ImportOptions) -> Result<Profile> {
    if opts.batch_size == 0 {
        return Err(Error::invalid("batch size 0 must be >= 1"));
    }
    if !(opts.param_bytes_scale.is_finite() && opts.param_bytes_scale > 0.0) {
        return Err(Error::invalid(format!(
            "parameter bytes scale {} must be a finite number > 0",
            opts.param_bytes_scale
        )));
    }
    let block_regex = opts
        .block_pattern
        .as_deref()
        .map(compile_block_pattern)
        .transpose()?;
    let graph = parse_graph(text)?;
    let order = topological_order(&graph)?;

    let mut chain_index = vec![0; order.len()];
    for (position, &node) in order.iter().enumerate() {
        chain_index[node] = position;
    }
    let layers = order
        .iter()
        .enumerate()
        .map(|(position, &node_index)| {
            let node = &graph.nodes[node_index];
            let mut inputs: Vec<usize> = graph.predecessors[node_index]
                .iter()
                .map(|&p| chain_index[p])
                .collect();
            inputs.sort_unstable();
            // A plain chain link is what an absent `inputs` means; leaving it
            // out keeps profiles of chain models small.
            let is_chain_link = position > 0 && inputs == [position - 1];
            let is_block = block_regex
                .as_ref()
                .is_some_and(|re| re.is_match(&node.name));
            Layer {
                weight_copy_bytes: None,
                name: node.name.clone(),
                kind: is_block.then(|| BLOCK_KIND.to_string()),
                param_bytes: (node.parameter_bytes * opts.param_bytes_scale).round() as u64,
                inputs: if is_chain_link { None } else { Some(inputs) },
                measurements: vec![Measurement {
                    backward_working_bytes: None,
                    recompute_fwd_ms: None,
                    selective_stored_bytes: None,
                    selective_recompute_ms: None,
                    experts_held_fwd_ms: None,
                    experts_held_bwd_ms: None,
                    bwd_weight_ms: None,
                    loss_stored_bytes: None,
                    batch_size: opts.batch_size,
                    fwd_ms: node.fwd_ms,
                    bwd_ms: node.bwd_ms,
                    activation_bytes: node.activation_bytes.round() as u64,
                    stored_activation_bytes: None,
                }],
                split: Vec::new(),
                experts: None,
                context: None,
            }
        })
        .collect();

    let profile = Profile {
        optimizer_step_ms: None,
        optimizer_step_bytes: None,
        dtype: None,
        allocator_reserved_factor: None,
        format: crate::formats::format::PROFILE.name.to_string(),
        schema_version: crate::formats::format::PROFILE.version,
        model: opts.model.clone(),
        source: opts.source.clone(),
        device: opts.device.clone(),
        optimizer: opts.optimizer.clone(),
        layers,
        other_devices: Vec::new(),
        parameter_state: None,
        model_flops_per_sample: None,
    };
    profile.validate()?;
    Ok(profile)
}

fn compile_block_pattern(pattern: &str) -> Result<Regex> {
    Regex::new(pattern).map_err(|e| {
        // The regex crate's message spans several lines; errors are one line.
        let reason = e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        Error::invalid(format!(
            "block pattern {pattern:?} is not a valid regex: {reason}"
        ))
    })
}

fn at_line(line: usize, message: impl std::fmt::Display) -> Error {
    Error::invalid(format!("line {line}: {message}"))
}

/// The first 80 characters of `text`, for quoting a bad line in an error.
fn excerpt(text: &str) -> String {
    let mut short: String = text.chars().take(80).collect();
    if short.len() < text.len() {
        short.push_str("...");
    }
    short
}

fn parse_graph(text: &str) -> Result<Graph> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut position_of: HashMap<String, usize> = HashMap::new();
    // Edges are resolved after all nodes are read, so their order in the file does not matter.
    let mut edges: Vec<(usize, &str, &str)> = Vec::new();
    for (line_index, raw_line) in text.lines().enumerate() {
        let line = line_index + 1;
        if raw_line.trim().is_empty() {
            continue;
        }
        if raw_line.starts_with(char::is_whitespace) {
            let ends: Vec<&str> = raw_line.trim().split(SEPARATOR).map(str::trim).collect();
            match ends.as_slice() {
                [from, to] if !from.is_empty() && !to.is_empty() => edges.push((line, from, to)),
                _ => {
                    return Err(at_line(
                        line,
                        format!(
                            "expected an edge `nodeA -- nodeB`, found {:?}",
                            excerpt(raw_line.trim())
                        ),
                    ))
                }
            }
            continue;
        }
        let node = parse_node(line, raw_line.trim_end())?;
        if let Some(&earlier) = position_of.get(&node.id) {
            return Err(at_line(
                line,
                format!(
                    "node id {:?} is already defined on line {}",
                    node.id, nodes[earlier].line
                ),
            ));
        }
        position_of.insert(node.id.clone(), nodes.len());
        nodes.push(node);
    }
    if nodes.is_empty() {
        return Err(Error::invalid(
            "the graph has no nodes; expected lines like `node1 -- name -- forward_compute_time=...`",
        ));
    }
    let mut predecessors = vec![BTreeSet::new(); nodes.len()];
    for (line, from, to) in edges {
        let lookup = |id: &str| {
            position_of
                .get(id)
                .copied()
                .ok_or_else(|| at_line(line, format!("edge names unknown node {id:?}")))
        };
        let (from, to) = (lookup(from)?, lookup(to)?);
        predecessors[to].insert(from);
    }
    Ok(Graph {
        nodes,
        predecessors,
    })
}

fn parse_node(line: usize, text: &str) -> Result<Node> {
    // Descriptions may themselves contain " -- ", commas and '=' (module
    // reprs), so the id ends at the first separator and the metrics start
    // after the last one.
    let (first, last) = match (text.find(SEPARATOR), text.rfind(SEPARATOR)) {
        // Two separators that do not overlap (" -- -- " holds one twice).
        (Some(first), Some(last)) if first + SEPARATOR.len() <= last => (first, last),
        _ => {
            return Err(at_line(
                line,
                format!(
                    "expected a node `nodeN -- description -- metrics` (edge lines start with whitespace), found {:?}",
                    excerpt(text)
                ),
            ))
        }
    };
    let id = text[..first].trim().to_string();
    let name = text[first + SEPARATOR.len()..last]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if id.is_empty() || name.is_empty() {
        return Err(at_line(
            line,
            format!(
                "node id and description must not be empty in {:?}",
                excerpt(text)
            ),
        ));
    }
    let [fwd_ms, bwd_ms, activation_bytes, parameter_bytes] =
        parse_metrics(line, &text[last + SEPARATOR.len()..])?;
    Ok(Node {
        id,
        name,
        line,
        fwd_ms,
        bwd_ms,
        activation_bytes,
        parameter_bytes,
    })
}

/// The four metrics in `METRIC_KEYS` order.
fn parse_metrics(line: usize, text: &str) -> Result<[f64; 4]> {
    let mut values: [Option<f64>; 4] = [None; 4];
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, raw) = part.split_once('=').ok_or_else(|| {
            at_line(
                line,
                format!("expected key=value, found {:?}", excerpt(part)),
            )
        })?;
        let key = key.trim();
        let slot = METRIC_KEYS.iter().position(|k| *k == key).ok_or_else(|| {
            at_line(
                line,
                format!(
                    "unknown metric {key:?}; expected {}",
                    METRIC_KEYS.join(", ")
                ),
            )
        })?;
        if values[slot].is_some() {
            return Err(at_line(line, format!("{key} is given twice")));
        }
        let raw = raw.trim();
        // A multi-output node lists one size per output; its output is their sum.
        let list = raw.strip_prefix('[').and_then(|r| r.strip_suffix(']'));
        values[slot] = Some(match list {
            Some(items) if key == "activation_size" => items
                .split(';')
                .map(|item| parse_number(line, key, item.trim()))
                .sum::<Result<f64>>()?,
            _ => parse_number(line, key, raw)?,
        });
    }
    let mut metrics = [0.0; 4];
    for (slot, value) in values.iter().enumerate() {
        metrics[slot] =
            value.ok_or_else(|| at_line(line, format!("missing {}", METRIC_KEYS[slot])))?;
    }
    Ok(metrics)
}

fn parse_number(line: usize, key: &str, raw: &str) -> Result<f64> {
    let value: f64 = raw
        .parse()
        .map_err(|_| at_line(line, format!("cannot parse {key} value {raw:?}")))?;
    if !value.is_finite() {
        return Err(at_line(
            line,
            format!("{key} value {raw:?} must be a finite number"),
        ));
    }
    if value < 0.0 {
        return Err(at_line(line, format!("{key} value {raw:?} must be >= 0")));
    }
    Ok(value)
}

/// Kahn's algorithm; among the nodes ready at the same time the one earliest
/// in the file goes first, so the chain is deterministic and follows the
/// file wherever the edges allow.
fn topological_order(graph: &Graph) -> Result<Vec<usize>> {
    let count = graph.nodes.len();
    let mut successors = vec![Vec::new(); count];
    for (to, from_set) in graph.predecessors.iter().enumerate() {
        for &from in from_set {
            successors[from].push(to);
        }
    }
    let mut unmet_inputs: Vec<usize> = graph.predecessors.iter().map(BTreeSet::len).collect();
    let mut ready: BinaryHeap<Reverse<usize>> = (0..count)
        .filter(|&i| unmet_inputs[i] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(count);
    while let Some(Reverse(node)) = ready.pop() {
        order.push(node);
        for &next in &successors[node] {
            unmet_inputs[next] -= 1;
            if unmet_inputs[next] == 0 {
                ready.push(Reverse(next));
            }
        }
    }
    if order.len() < count {
        let stuck: Vec<&str> = (0..count)
            .filter(|&i| unmet_inputs[i] > 0)
            .map(|i| graph.nodes[i].id.as_str())
            .collect();
        let shown = stuck
            .iter()
            .take(10)
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        let more = if stuck.len() > 10 {
            format!(" and {} more", stuck.len() - 10)
        } else {
            String::new()
        };
        return Err(Error::invalid(format!(
            "the edges form a cycle; these nodes are on or after it: {shown}{more}"
        )));
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(block_pattern: Option<&str>, param_bytes_scale: f64) -> ImportOptions {
        ImportOptions {
            model: "test".into(),
            batch_size: 8,
            param_bytes_scale,
            block_pattern: block_pattern.map(String::from),
            source: None,
            device: Some("V100-16GB".into()),
            optimizer: "adam".into(),
        }
    }

    fn node(id: &str, name: &str, activation: &str, params: &str) -> String {
        format!("{id} -- {name} -- forward_compute_time=1.5, backward_compute_time=3.000, activation_size={activation}, parameter_size={params}\n")
    }

    fn import(text: &str) -> Result<Profile> {
        import_graph_txt(text, &options(None, 1.0))
    }

    fn names(p: &Profile) -> Vec<&str> {
        p.layers.iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn imports_branches_multi_outputs_blocks_and_scale() {
        let text = node("node1", "Input", "[100; 28.0]", "0")
            + &node("node2", "layer_0", "64.0", "1000.000")
            + &node("node3", "Dropout(p=0.2,   inplace=True)", "64", "0")
            + &node("node4", "layer_1", "9175040.0", "1000")
            + "\tnode1 -- node2\n  node2 -- node3\n\tnode3 -- node4\n\tnode1 -- node4\n\tnode1 -- node4\n";
        let p = import_graph_txt(&text, &options(Some(r"^layer_\d+$"), 1.048576)).unwrap();
        assert_eq!(
            names(&p),
            [
                "Input",
                "layer_0",
                "Dropout(p=0.2, inplace=True)",
                "layer_1"
            ]
        );
        let inputs: Vec<_> = p.layers.iter().map(|l| l.inputs.clone()).collect();
        assert_eq!(inputs, [Some(vec![]), None, None, Some(vec![0, 2])]);
        assert_eq!(p.layers[0].measurements[0].activation_bytes, 128);
        assert_eq!(p.layers[3].measurements[0].activation_bytes, 9175040);
        let kinds: Vec<_> = p.layers.iter().map(|l| l.kind.as_deref()).collect();
        assert_eq!(kinds, [None, Some(BLOCK_KIND), None, Some(BLOCK_KIND)]);
        assert_eq!(p.layers[1].param_bytes, 1049); // 1000 * 1.048576, rounded
        let m = &p.layers[1].measurements[0];
        assert_eq!((m.batch_size, m.fwd_ms, m.bwd_ms), (8, 1.5, 3.0));
        assert_eq!(p.device.as_deref(), Some("V100-16GB"));
    }

    #[test]
    fn ready_nodes_are_taken_in_file_order() {
        // nodeB waits for nodeC, which comes later in the file; nodeA and
        // nodeC are both sources, so nodeA (earlier) goes first.
        let text = node("nodeB", "B", "1", "0")
            + &node("nodeA", "A", "1", "0")
            + &node("nodeC", "C", "1", "0")
            + "\tnodeC -- nodeB\n";
        let p = import(&text).unwrap();
        assert_eq!(names(&p), ["A", "C", "B"]);
        let inputs: Vec<_> = p.layers.iter().map(|l| l.inputs.clone()).collect();
        assert_eq!(inputs, [Some(vec![]), Some(vec![]), None]);
    }

    fn error_of(text: &str) -> String {
        import(text).unwrap_err().to_string()
    }

    #[test]
    fn bad_input_errors_name_the_line_or_node() {
        assert!(error_of("").contains("no nodes"));
        assert!(error_of("\tnode1 -- node2\n").contains("no nodes"));

        let bad_number = node("node1", "x", "1", "0").replace("1.5", "abc");
        assert_eq!(
            error_of(&bad_number),
            r#"line 1: cannot parse forward_compute_time value "abc""#
        );
        let negative = node("node1", "x", "1", "0") + &node("node2", "y", "[1; -2]", "0");
        assert!(error_of(&negative).starts_with(r#"line 2: activation_size value "-2""#));
        for not_finite in ["inf", "NaN"] {
            let text = node("node1", "x", "1", not_finite);
            assert!(
                error_of(&text).contains(&format!("line 1: parameter_size value {not_finite:?}"))
            );
        }
        let missing = "node1 -- x -- forward_compute_time=1, activation_size=1, parameter_size=0\n";
        assert!(error_of(missing).contains("line 1: missing backward_compute_time"));

        let unknown = node("node1", "x", "1", "0") + "\tnode1 -- node9\n";
        assert_eq!(
            error_of(&unknown),
            r#"line 2: edge names unknown node "node9""#
        );
        let duplicate = node("node1", "x", "1", "0") + &node("node1", "y", "1", "0");
        assert!(error_of(&duplicate)
            .contains(r#"line 2: node id "node1" is already defined on line 1"#));
        let unindented_edge = node("node1", "x", "1", "0") + "node1 -- node1\n";
        assert!(error_of(&unindented_edge).starts_with("line 2: expected a node"));
        // Separators that overlap are one, not a node (found by the
        // command-line fuzz campaign: it panicked slicing the text).
        for overlapping in ["node -- -- --\n", "n -- --\n"] {
            assert!(
                error_of(overlapping).starts_with("line 1: expected a node"),
                "{overlapping:?}"
            );
        }

        let cycle = node("node1", "x", "1", "0")
            + &node("node2", "y", "1", "0")
            + &node("node3", "z", "1", "0")
            + "\tnode1 -- node2\n\tnode2 -- node3\n\tnode3 -- node2\n";
        let message = error_of(&cycle);
        assert!(
            message.contains("cycle") && message.contains("node2, node3"),
            "{message}"
        );
        assert!(!message.contains("node1"), "{message}");

        let text = node("node1", "x", "1", "0");
        let bad_regex = import_graph_txt(&text, &options(Some("layer_(\\d+"), 1.0))
            .unwrap_err()
            .to_string();
        assert!(
            bad_regex.contains(r#""layer_(\\d+""#) && !bad_regex.contains('\n'),
            "{bad_regex}"
        );
    }

    /// Imports the artifact's files when they are present (they are not part
    /// of the repository, so the test passes silently without them).
    #[test]
    fn imports_the_dapple_artifact_files() {
        let dir = std::path::Path::new("/work/shared/profiles/dapple-artifact");
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        // (file, block pattern, layers, blocks). amoeba-6 "complicated" has
        // 5: its cell 3 is split into pieces and the whole is named "cell3".
        let expected: &[(&str, &str, usize, usize)] = &[
            ("bert-48-pbs-2.txt", r"^layer_\d+$", 53, 48),
            ("bert-24-pbs-6.txt", r"^layer_\d+$", 29, 24),
            ("gnmt-16-pbs-64.txt", "LSTM|RecurrentAttention", 96, 16),
            ("gnmt-32-pbs-64.txt", "LSTM|RecurrentAttention", 192, 32),
            (
                "gnmt-32-pbs-64-simplified.txt",
                "LSTM|RecurrentAttention",
                67,
                32,
            ),
            ("amoeba-36-pbs-1.txt", r"^cell_\d+$", 44, 36),
            ("amoeba-18-pbs-8.txt", r"^cell_\d+$", 26, 18),
            ("amoeba-6-pbs-8-simplified.txt", r"^cell_\d+$", 14, 6),
            ("amoeba-6-pbs-8-complicated.txt", r"^cell_\d+$", 20, 5),
            ("xlnet-36-pbs-1.txt", r"^Layer_\d+$", 43, 36),
            ("xlnet-24-pbs-1.txt", r"^Layer_\d+$", 31, 24),
            ("vgg-19-pbs-32.txt", "^$", 26, 0),
            ("vgg16.txt", "^$", 41, 0),
        ];
        let mut seen = 0;
        for entry in entries {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_string_lossy().to_string();
            if !file.ends_with(".txt") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let known = expected.iter().find(|e| e.0 == file);
            let scale = if file.starts_with("vgg-19") {
                1.048576
            } else {
                1.0
            };
            let opts = options(known.map(|e| e.1), scale);
            let p = import_graph_txt(&text, &opts)
                .map_err(|e| e.in_source(&file))
                .unwrap();
            let Some(&(_, _, layers, blocks)) = known else {
                continue;
            };
            let block_count = p
                .layers
                .iter()
                .filter(|l| l.kind.as_deref() == Some(BLOCK_KIND))
                .count();
            assert_eq!((p.layers.len(), block_count), (layers, blocks), "{file}");
            if file == "gnmt-16-pbs-64.txt" {
                // Input1 is listed after the encoder LSTM it feeds.
                assert_eq!(
                    names(&p)[..3],
                    ["Input0", "Embedding(36560, 1024, padding_idx=0)", "Input1"]
                );
                assert_eq!(p.layers[3].inputs, Some(vec![1, 2]));
            }
            seen += 1;
        }
        assert_eq!(
            seen,
            expected.len(),
            "some expected artifact files are missing"
        );
    }
}
