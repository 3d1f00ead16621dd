//! The web page at `/` and its assets, over real HTTP (the browser test is
//! scripts/web-test.sh): content types, the CSP, and that every asset the page names loads.

use crate::common;

use common::*;

const CSP_NEEDS: &[&str] = &[
    "default-src 'none'",
    "script-src 'self'",
    "connect-src 'self'",
];

fn check_asset(resp: &HttpResponse, content_type: &str) {
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("content-type"), Some(content_type));
    let csp = resp.header("content-security-policy").unwrap_or_default();
    for part in CSP_NEEDS {
        assert!(csp.contains(part), "CSP `{csp}` lacks {part}");
    }
    assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
}

/// The same-origin paths an HTML page refers to with `src="/..."` or `href="/..."`.
fn referenced_paths(html: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for attr in ["src=\"/", "href=\"/"] {
        for (at, _) in html.match_indices(attr) {
            let start = at + attr.len() - 1;
            let end = html[start..].find('"').map_or(html.len(), |n| start + n);
            paths.push(html[start..end].to_string());
        }
    }
    paths
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_and_assets_load_with_their_content_types() {
    let server = start().await;
    let page = get(server.addr, "/").await;
    check_asset(&page, "text/html; charset=utf-8");
    let html = page.text();
    assert!(html.contains("id=\"messages\"") && html.contains("id=\"heatmap\""));
    // No inline script or style: the CSP would block them.
    assert!(!html.contains("<script>") && !html.contains("style=\""));

    let paths = referenced_paths(&html);
    assert!(paths.contains(&"/assets/app.js".to_string()), "{paths:?}");
    assert!(paths.contains(&"/assets/app.css".to_string()), "{paths:?}");
    for path in paths {
        let resp = get(server.addr, &path).await;
        let content_type = if path.ends_with(".js") {
            "text/javascript; charset=utf-8"
        } else {
            "text/css; charset=utf-8"
        };
        check_asset(&resp, content_type);
        assert!(!resp.body.is_empty(), "{path} is empty");
    }
    // The dashboard reads these names from /metrics; a rename must show up here.
    let script = get(server.addr, "/assets/app.js").await.text();
    let metrics = get(server.addr, "/metrics").await.text();
    for name in [
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:request_success_total",
        "kimi:moe_expert_tokens_total",
    ] {
        assert!(script.contains(name), "app.js does not read {name}");
        assert!(metrics.contains(name), "/metrics has no {name}");
    }
    get(server.addr, "/assets/missing.js")
        .await
        .expect_error(404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_is_public_while_the_api_needs_a_key() {
    let mut config = server_config();
    config.api_keys = vec!["page-key".into()];
    let server = start_with(config, serving_config()).await;
    check_asset(&get(server.addr, "/").await, "text/html; charset=utf-8");
    get(server.addr, "/v1/models").await.expect_error(401);
}
