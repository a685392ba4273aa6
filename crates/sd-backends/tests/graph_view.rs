//! `Graph::view` relies on the layout of ggml's private `struct ggml_cgraph` (declared in
//! ggml-sys for the pinned version): ggml's public accessors must read the view as intended.

use sd_backends::Context;

#[test]
fn graph_view_matches_ggml() {
    let g = Context::for_graph(64, 64).unwrap();
    let a = g.new_f32(&[4, 4]);
    let b = g.new_f32(&[4, 4]);
    let mut t = g.add(a, b);
    for _ in 0..5 {
        t = g.mul(t, b);
    }
    let graph = g.new_graph(64);
    graph.expand(t);
    let n = graph.n_nodes();
    assert_eq!(n, 6);
    let view = graph.view(2..5);
    let v = view.graph();
    // ggml_graph_n_nodes / ggml_graph_node read the struct through ggml's own definition.
    assert_eq!(v.n_nodes(), 3);
    for i in 0..3 {
        assert_eq!(v.node(i), graph.node(i + 2), "node {i} of the view");
    }
    // Ranges are clamped to the graph.
    assert_eq!(graph.view(4..100).graph().n_nodes(), 2);
    assert_eq!(graph.view(7..9).graph().n_nodes(), 0);
}
