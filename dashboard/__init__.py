"""The labavg dashboard (Panel + HoloViews): dashboard.app.create_app / serve; state in dashboard.settings, dashboard.live and dashboard.runs_table."""
